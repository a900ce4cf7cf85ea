"""bench/serve_bench.py, small, against an in-process stack and server: every run, every column,
the prefill-alone line and the transformers baseline row with its ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import serve_bench
from tests.frontend.serve_fixtures import serving, stack_config
from tests.worker_svc.conftest import build_hf_model


def test_serve_bench_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.frontend.launch.local_stack import LocalStack

    bench = serve_bench
    hf = build_hf_model(tmp_path / "model", seed=1)
    out = tmp_path / "rows.json"
    with LocalStack(stack_config(hf, num_gpu_blocks=256)) as st, serving(st, model_name="tiny") as srv:
        code = bench.main(
            [
                "--url",
                srv.url,
                "--model",
                str(hf.path),
                "--num-requests",
                "8",
                "--rates",
                "20,inf",
                "--max-concurrency",
                "4",
                "--system-len",
                "16",
                "--input-len",
                "8",
                "--output-len",
                "6",
                "--alone-requests",
                "2",
                "--baseline-batch-size",
                "4",
                "--json",
                str(out),
            ]
        )
    text = capsys.readouterr().out
    assert code == 0, text
    for label in (
        "rate 20 req/s",
        "offline (all at once)",
        "max concurrency 4",
        "transformers static (batch 4",
        "TTFT ms mean/p50/p99",
        "TPOT ms mean/p50/p99",
        "ITL ms mean/p50/p99",
        "prefix hits",
        "prefill alone",
        "target <= 1.3x",
    ):
        assert label in text, label
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    offline = rows["offline (all at once)"]
    assert offline["failed"] == 0 and offline["requests"] == 8 and offline["out_tok_per_s"] > 0
    assert 0 < offline["hit_rate"] < 1  # shared system prompts hit, the user turns do not
    assert all(0 < t for t in offline["ttft"])
    baseline = next(r for n, r in rows.items() if n.startswith("transformers"))
    assert baseline["out_tok_per_s"] > 0
