"""bench/vs_llamacpp.py: its requests, its table's arithmetic, and a clean skip without llama.cpp.

The comparison itself needs a llama-server binary built from source (docs/benchmarks.md), which CI
does not have; what CI checks is what the table claims from the passes it is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_llamacpp
from bench.vs_llamacpp import Pass, Req, Server, Stream

ROOT = Path(__file__).resolve().parents[2]


def test_requests_share_three_system_prompts_and_stay_within_their_bounds() -> None:
    reqs = vs_llamacpp.make_requests(32, 49152, seed=0)
    assert reqs == vs_llamacpp.make_requests(32, 49152, seed=0)
    assert reqs != vs_llamacpp.make_requests(32, 49152, seed=1)
    for i, r in enumerate(reqs):
        head = vs_llamacpp.SYSTEM_PROMPTS[i % 3]
        assert r.prompt[:head] == reqs[i % 3].prompt[:head]
        assert 4 <= len(r.prompt) - head <= 200 and 8 <= r.max_tokens <= 128
        assert all(vs_llamacpp.FIRST_ID <= t < 49152 for t in r.prompt)
    # three different system prompts, and user turns that differ
    assert len({tuple(r.prompt[:64]) for r in reqs}) == 3
    assert len({tuple(r.prompt) for r in reqs}) == 32
    # another round: the same system prompts, new user turns (no whole prompt repeats from round 0)
    again = vs_llamacpp.make_requests(32, 49152, seed=0, turn=1)
    for i, (a, b) in enumerate(zip(reqs, again, strict=True)):
        head = vs_llamacpp.SYSTEM_PROMPTS[i % 3]
        assert a.prompt[:head] == b.prompt[:head] and a.prompt != b.prompt


def _server(name: str, weights: str) -> Server:
    return Server(name, weights, lambda r: [], lambda: [], lambda: None)


def test_the_table_gives_medians_and_per_round_ratios_of_its_own_passes() -> None:
    servers = [_server("llama.cpp Q", "Q"), _server("llama.cpp F32", "F32"), _server("pagedkv Q", "Q")]
    outs = [[1, 2, 3], [4, 5]]
    passes = {
        # tok/s 10, 20, 40
        "llama.cpp Q": [Pass(1.0, 10, outs), Pass(0.5, 10, outs), Pass(0.25, 10, outs)],
        # tok/s 5, 5, 5
        "llama.cpp F32": [Pass(2.0, 10, outs), Pass(2.0, 10, outs), Pass(2.0, 10, outs)],
        # tok/s 30, 10, 20: per round vs Q 3.0, 0.5, 0.5 (median 0.5, where the medians' quotient is
        # 1.0); vs F32 6, 2, 4 (median 4)
        "pagedkv Q": [Pass(1 / 3, 10, [[1, 2, 9], [4, 5]]), Pass(1.0, 10, outs), Pass(0.5, 10, outs)],
    }
    reqs = [Req([7] * 5, 3), Req([8] * 6, 2)]
    lines = vs_llamacpp.table("2 in flight", reqs, passes, servers, {s.name: 2048 for s in servers})
    assert "2 requests a round (round 1: 11 prompt tokens, 5 generated" in lines[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[4:]}
    assert rows["llama.cpp Q"][:2] == ["Q", "20.0"]
    assert rows["llama.cpp F32"][1] == "5.0"
    assert rows["pagedkv Q"] == ["Q", "20.0", "30.0, 10.0, 20.0", "0.50x", "4.00x", "2", "4/5 = 80.0%"]


def test_without_a_llama_server_binary_it_says_so_and_exits_zero(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDKV_LLAMA_SERVER",)}
    env["PATH"] = str(tmp_path)  # no llama-server on it
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vs_llamacpp"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped: no llama-server binary" in proc.stdout


def test_pagedkv_rows_are_the_default_stack_and_flagged_extras() -> None:
    """No thread count or pagedkv setting of the bench's own: llama-server's threads come from the
    default stack's plan, and a tuned pagedkv row is `up` flags, named by them."""
    p = vs_llamacpp.build_parser()
    assert "--threads" not in p.format_help()
    args = p.parse_args(["--pagedkv-row=--num-workers 2", "--pagedkv-row=--no-pin-workers"])
    assert args.pagedkv_row == ["--num-workers 2", "--no-pin-workers"]
    assert vs_llamacpp.weights_of("auto") == "Q" and vs_llamacpp.weights_of("fp32") == "F32"


def test_long_prompts_are_fresh_each_round_and_length_and_the_same_for_every_server() -> None:
    a = vs_llamacpp.long_request(2048, 262144, seed=0, turn=0)
    assert a == vs_llamacpp.long_request(2048, 262144, seed=0, turn=0)  # every server: the same ids
    assert len(a.prompt) == 2048 and a.max_tokens == vs_llamacpp.LONG_TOKENS
    assert all(vs_llamacpp.FIRST_ID <= t < 262144 for t in a.prompt)
    # another round, or another length: a new prompt from its first token (no shared prefix block)
    b = vs_llamacpp.long_request(2048, 262144, seed=0, turn=1)
    c = vs_llamacpp.long_request(8192, 262144, seed=0, turn=0)
    assert a.prompt[:16] != b.prompt[:16] and a.prompt[:16] != c.prompt[:16]
    assert vs_llamacpp.build_parser().parse_args(["--long-prompts", "2048,8192,16384"]).long_prompts == [
        2048,
        8192,
        16384,
    ]
    assert vs_llamacpp.build_parser().parse_args([]).vocab is None  # the file's vocabulary


def test_a_stream_times_the_first_token_and_the_decode_after_it() -> None:
    # sent at 10.0; an event without tokens first (a role chunk), then 1 token at 12.0, 2 at 12.5,
    # 1 at 13.0, and a usage event without tokens at 13.5
    events = [(10.5, []), (12.0, [7]), (12.5, [8, 9]), (13.0, [10]), (13.5, [])]
    st = vs_llamacpp.stream_of(10.0, events, 4, "x")
    assert st.ttft == 2.0 and st.decode_s == 1.0 and st.decode_tokens == 3 and st.decode_tok_s == 3.0
    assert st.tokens == [7, 8, 9, 10]
    with pytest.raises(RuntimeError, match="asked for 5 tokens, streamed 4"):
        vs_llamacpp.stream_of(10.0, events, 5, "x")
    with pytest.raises(RuntimeError, match="one event"):
        vs_llamacpp.stream_of(10.0, [(11.0, [1, 2])], 2, "x")


def test_the_long_table_gives_medians_and_per_round_ratios_faster_above_one() -> None:
    servers = [_server("llama.cpp Q", "Q"), _server("pagedkv Q", "Q")]

    def st(ttft: float, tok_s: float, tokens: list[int]) -> Stream:
        return Stream(ttft, 1.0, int(tok_s), tokens)

    long = {
        8192: {
            # TTFT 10, 20, 40 s; decode 10, 10, 10 tok/s
            "llama.cpp Q": [st(10, 10, [1, 2]), st(20, 10, [1, 2]), st(40, 10, [1, 2])],
            # TTFT 5, 40, 20 s: per round its / this 2.0, 0.5, 2.0 (median 2.0); decode 30, 5, 20
            "pagedkv Q": [st(5, 30, [1, 3]), st(40, 5, [1, 2]), st(20, 20, [1, 2])],
        }
    }
    lines = vs_llamacpp.long_table(long, servers, 2)
    assert "2 tokens generated; median of 3 rounds" in lines[0]
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in lines[6:]}
    assert rows["llama.cpp Q"] == ["8,192", "llama.cpp Q", "Q", "20.000", "10.000, 20.000, 40.000", "-"] + [
        "410",
        "10.0",
        "10.0, 10.0, 10.0",
        "-",
        "-",
    ]
    assert rows["pagedkv Q"] == ["8,192", "pagedkv Q", "Q", "20.000", "5.000, 40.000, 20.000", "2.00x"] + [
        "410",
        "20.0",
        "30.0, 5.0, 20.0",
        "2.00x",
        "5/6 = 83.3%",
    ]
