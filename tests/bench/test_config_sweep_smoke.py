"""bench/config_sweep.py: the default stack beside the hand configurations, in its smoke mode (the
built-in tiny model): the table has the default row and every ratio to the best, and the default's
stack is exactly what `pagedkv up` runs with no flags (the rule the benchmarks keep: a figure called
the default's is of the stack a user starts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench import config_sweep, up_stack
from pagedkv.frontend.launch.processes import up_config
from tests.bench.tables import run_bench


def test_the_default_comes_first_and_every_configuration_plans_differently() -> None:
    every = config_sweep.configurations(None)
    assert every[0] == ()
    assert all(f for f in every[1:]) and len(set(every)) == len(every)
    # The rows that set an environment (the OpenMP spin) run the default's flags.
    assert [f for f in every if up_stack.split_env(f)[0]] == list(config_sweep.SPIN_ROWS)
    flags = [f for f in every if not up_stack.split_env(f)[0]]
    assert all(up_stack.split_env(f)[1] == [] for f in config_sweep.SPIN_ROWS)
    plans = [config_sweep._signature(up_config(list(f))) for f in flags]
    assert len(set(plans)) == len(plans)  # none runs the same workers, cores and threads as another
    assert any("--no-pin-workers" in f for f in flags)


def test_config_sweep_smoke(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    stdout = run_bench("config_sweep", "--smoke", "--json", str(out), timeout=240)
    rows = {
        cells[0]: cells[1:]
        for cells in (
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in stdout.splitlines()
            if line.startswith("| pagedkv")
        )
    }
    assert "pagedkv (default)" in rows and len(rows) >= 2
    for cells in rows.values():
        # workers x threads | 1 in flight: tok/s, passes, vs best | 32 in flight: the same
        assert float(cells[1]) > 0 and float(cells[4]) > 0
        assert cells[3].endswith("x") and cells[6].endswith("x")
    assert any(c[3] == "1.00x" for c in rows.values()) and any(c[6] == "1.00x" for c in rows.values())
    assert any(
        line.startswith("default: ") and "the best at 32 in flight" in line for line in stdout.splitlines()
    )

    data = json.loads(out.read_text())
    default = next(c for c in data["configs"] if c["default"])
    assert default["label"] == "pagedkv (default)" and default["flags"] == []
    # the stack the default row ran is `pagedkv up` with no flags (the smoke's model: the built-in one)
    assert default["config"] == json.loads(json.dumps(up_stack.comparable(up_config([]))))
    for c in data["configs"]:
        assert len(c["passes"]["1"]) == len(c["passes"]["32"]) == data["rounds"] == 1
        assert c["vs_best"]["1"] > 0 and c["vs_best"]["32"] > 0
    assert not _left_by_exited_benches()


def _left_by_exited_benches() -> list[Path]:
    """The bench's shared-memory segments (``pagedkv-vsllama-<pid>-...``) whose process has exited: a
    bench still running beside this one (the slow tier runs modules in parallel) owns its own."""
    left = []
    for p in Path("/dev/shm").iterdir():
        if p.name.startswith("pagedkv-vsllama-"):
            pid = int(p.name.split("-")[2])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                left.append(p)
    return left
