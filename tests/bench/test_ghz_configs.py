"""bench/ghz/*.json: valid ghz configs for the block manager, and a run order that leaves the pool empty.

ghz cannot run here, so the test (1) checks the keys ghz reads (runner.Config's JSON names), (2)
checks every call exists in the service descriptor and every data field in its input message,
and (3) replays the documented order Allocate -> Append -> Fork -> Step -> Free against an
in-process block manager, rendering the templates the way ghz does for the subset used
(`.RequestNumber`, sprig's `add`, `mul`, `div` and `mod`) with fewer calls, and checks that every
call succeeds and the pool ends where it started. The Step config is the engine's iteration Step
(commits, frees, appends with token ids, allocations with token ids), so its packed arrays are
checked against each other the way the service checks them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.v1 import block_manager_pb2 as pb

GHZ = Path(__file__).resolve().parents[2] / "bench" / "ghz"
ORDER = ["allocate", "append", "fork", "step", "free"]
# JSON names of ghz's runner.Config (github.com/bojand/ghz/runner/config.go).
GHZ_KEYS = {
    "proto",
    "protoset",
    "call",
    "cacert",
    "cert",
    "key",
    "skipTLS",
    "skipFirst",
    "cname",
    "authority",
    "insecure",
    "total",
    "async",
    "concurrency",
    "concurrency-schedule",
    "concurrency-start",
    "concurrency-end",
    "concurrency-step",
    "concurrency-step-duration",
    "concurrency-max-duration",
    "connections",
    "rps",
    "duration",
    "duration-stop",
    "max-duration",
    "timeout",
    "data",
    "data-file",
    "binary-file",
    "metadata",
    "metadata-file",
    "stream-interval",
    "output",
    "format",
    "connect-timeout",
    "keepalive",
    "cpus",
    "import-paths",
    "name",
    "tags",
    "reflect-metadata",
    "debug",
    "host",
    "enable-compression",
    "load-schedule",
    "load-start",
    "load-end",
    "load-step",
    "load-step-duration",
    "load-max-duration",
}
SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"]
TEMPLATE = re.compile(r"\{\{(.*?)\}\}")


def configs() -> dict[str, dict[str, Any]]:
    return {name: json.loads((GHZ / f"{name}.json").read_text()) for name in ORDER}


def render(value: Any, n: int) -> Any:
    """ghz evaluates Go templates in the data per call; this handles the expressions we use."""
    if isinstance(value, dict):
        return {k: render(v, n) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, n) for v in value]
    if not isinstance(value, str):
        return value

    def expr(m: re.Match[str]) -> str:
        return str(evaluate(m.group(1), n))

    return TEMPLATE.sub(expr, value)


SPRIG = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
}


def evaluate(text: str, n: int) -> int:
    """A Go template pipeline of sprig integer functions: `fn arg arg`, args are ints,
    `.RequestNumber` or parenthesised pipelines (sprig's div and mod on int64 are floor ops for
    the non-negative values used here)."""
    tokens = re.findall(r"\(|\)|[^\s()]+", text)
    pos = 0

    def call() -> int:
        nonlocal pos
        fn = tokens[pos]
        assert fn in SPRIG, f"template function not understood by this test: {fn!r} in {text!r}"
        pos += 1
        args = []
        while pos < len(tokens) and tokens[pos] != ")":
            tok = tokens[pos]
            pos += 1
            if tok == "(":
                args.append(call())
                assert tokens[pos] == ")", text
                pos += 1
            elif tok == ".RequestNumber":
                args.append(n)
            else:
                args.append(int(tok))
        assert len(args) == 2, text
        return SPRIG[fn](*args)

    if text.strip() == ".RequestNumber":
        return n
    value = call()
    assert pos == len(tokens), text
    return value


def test_every_config_has_the_keys_ghz_needs() -> None:
    assert sorted(p.stem for p in GHZ.glob("*.json")) == sorted(ORDER)
    for name, cfg in configs().items():
        assert set(cfg) <= GHZ_KEYS, (name, set(cfg) - GHZ_KEYS)
        assert {"call", "host", "insecure", "concurrency", "data"} <= set(cfg), name
        assert "total" in cfg or "duration" in cfg, name  # bounded
        assert "proto" not in cfg and "protoset" not in cfg, name  # server reflection
        assert cfg["insecure"] is True
        assert cfg["host"].startswith("127.0.0.1:"), name  # loopback only in shipped examples
        assert isinstance(cfg["total"], int) and cfg["concurrency"] <= cfg["total"]
        assert cfg["data"].keys() and cfg["timeout"].endswith("s")


def test_calls_and_fields_exist_in_the_service() -> None:
    for name, cfg in configs().items():
        service, _, method = cfg["call"].partition("/")
        assert service == SERVICE.full_name, name
        assert method in SERVICE.methods_by_name, name
        input_type = SERVICE.methods_by_name[method].input_type
        for field in cfg["data"]:
            assert field in input_type.fields_by_name, (name, field)
        # the rendered data parses as the input message (ghz uses protojson the same way)
        json_format.ParseDict(render(cfg["data"], 7), getattr(pb, input_type.name)())


def test_step_is_the_engines_iteration_step() -> None:
    """Every kind of item the engine packs into its per-iteration Step, with consistent arrays."""
    data = configs()["step"]["data"]
    for n in (0, 1, 17, 999):
        d = render(data, n)
        msg = json_format.ParseDict(d, pb.StepRequest())
        assert len(msg.append_seq_ids) == 256 and len(msg.append_token_ids) == 256  # a token id each
        assert 0 < len(msg.commit_seq_ids) == len(msg.commit_num_computed_tokens) < 256  # a few commits
        assert set(msg.commit_seq_ids) <= set(msg.append_seq_ids)
        # block boundaries, below the 16 + 19 + (steps done) tokens each sequence has by then
        assert all(c % 16 == 0 and 0 < c <= 16 + n for c in msg.commit_num_computed_tokens)
        assert msg.free_seq_ids and list(msg.alloc_seq_ids) == list(msg.free_seq_ids)  # freed, re-admitted
        assert not set(msg.free_seq_ids) & set(msg.append_seq_ids)
        assert len(msg.alloc_num_tokens) == len(msg.alloc_seq_ids)
        assert len(msg.alloc_token_ids) == sum(msg.alloc_num_tokens)  # ids for every prompt token
        assert not msg.appends and not msg.frees  # the packed form the engine sends


def test_documented_order_runs_clean_and_restores_the_pool() -> None:
    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=32768, log_level="warning"))
    limits = {"append": 1000, "step": 20}  # fewer calls than the configs, same id patterns
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}") as bm:
            stub = bm._stub
            for name, cfg in configs().items():
                method = getattr(stub, cfg["call"].rsplit("/", 1)[1])
                input_cls = getattr(
                    pb, SERVICE.methods_by_name[cfg["call"].rsplit("/", 1)[1]].input_type.name
                )
                for n in range(min(cfg["total"], limits.get(name, cfg["total"]))):
                    resp = method(json_format.ParseDict(render(cfg["data"], n), input_cls()), timeout=5)
                    if name == "step":
                        assert not resp.errors, resp.errors[0]
                if name == "step":  # the commits registered blocks: block 0 of 0..255, block 1 of 0..63
                    assert bm.get_stats().num_committed_blocks >= 256 + 64
            stats = bm.get_stats()
            assert stats.num_sequences == 0 and stats.num_used_blocks == 0
    finally:
        running.stop(None)


@pytest.mark.parametrize("start", [0, 1])
def test_id_coverage_does_not_depend_on_where_request_numbers_start(start: int) -> None:
    cfg = configs()
    allocated = {
        render(cfg["allocate"]["data"], n)["seq_id"] for n in range(start, start + cfg["allocate"]["total"])
    }
    children = {
        render(cfg["fork"]["data"], n)["child_seq_id"] for n in range(start, start + cfg["fork"]["total"])
    }
    freed = {render(cfg["free"]["data"], n)["seq_id"] for n in range(start, start + cfg["free"]["total"])}
    assert len(allocated) == 512 and len(children) == 512 and not allocated & children
    assert freed == allocated | children
    assert set(cfg["step"]["data"]["append_seq_ids"]) <= allocated
    # The Step frees and re-allocates fork children (they exist before it and free.json frees them after).
    steps = range(start, start + cfg["step"]["total"])
    churn = {i for n in steps for i in render(cfg["step"]["data"], n)["free_seq_ids"]}
    assert churn <= children and len(churn) == 256
