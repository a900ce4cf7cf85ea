"""`bench.faults serve --chaos --seed N`: the fault schedule comes from the seed alone, so a chaos run
can be repeated (bench/fault_scenarios/serve_faults.py ``chaos_schedule``)."""

from __future__ import annotations

import pytest

from bench import faults
from bench.fault_scenarios.serve_faults import chaos_schedule, describe_schedule

LASTS = {
    "block-manager SIGKILL": 0.0,
    "worker-0 SIGSTOP 8 s": 8.0,
    "block-manager link black-holed 10 s": 10.0,
}


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    one = chaos_schedule(7, LASTS, 120.0, (3.0, 6.0))
    assert one == chaos_schedule(7, LASTS, 120.0, (3.0, 6.0))
    assert one != chaos_schedule(8, LASTS, 120.0, (3.0, 6.0))
    assert len(one) >= 5
    t = 0.0
    for f in one:  # each fault a wait of 3-6 s after the previous one ended, all within the run
        assert 3.0 <= f.wait_s <= 6.0 and f.what in LASTS
        assert f.at_s == pytest.approx(t + f.wait_s, abs=0.02) and f.at_s < 120.0
        t = f.at_s + LASTS[f.what]
    text = describe_schedule(7, one)
    assert text.startswith("chaos schedule (--seed 7): ") and text.count(";") == len(one) - 1


def test_the_cli_takes_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def run_chaos(**kw: object) -> dict[str, object]:
        seen.update(kw)
        raise SystemExit(0)  # stop before anything would start

    monkeypatch.setattr(faults, "run_chaos", run_chaos)
    # main() configures logging for a run (warning level, loggers cached): in-process that would
    # silence every later test's captured info events.
    monkeypatch.setattr("pagedkv.logging_setup.configure_logging", lambda *a, **k: None)
    with pytest.raises(SystemExit):
        faults.main(["serve", "--chaos", "--seconds", "5", "--seed", "3"])
    assert seen["seed"] == 3 and seen["seconds"] == 5.0


def test_fence_events_are_counted_from_the_frontend_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from bench.fault_scenarios.serve_faults import _fence_events

    (tmp_path / "frontend.log").write_text(
        "timestamp='t' level='warning' event='step_fenced' worker='127.0.0.1:5' request_id='step-a-1.0'\n"
        "timestamp='t' level='warning' event='step_fenced' worker='127.0.0.1:5' request_id='step-a-2'\n"
        "timestamp='t' level='warning' event='worker_benched' worker='127.0.0.1:5' reason='UNAVAILABLE'\n"
        "timestamp='t' level='warning' event='fence_released' worker='127.0.0.1:5' "
        "request_ids=['step-a-1.0', 'step-a-2'] held_s=4.1 reason='answered'\n"
    )
    stack = SimpleNamespace(opts=SimpleNamespace(log_dir=str(tmp_path)))
    assert _fence_events(stack) == (2, 2)  # type: ignore[arg-type]
    missing = SimpleNamespace(opts=SimpleNamespace(log_dir=str(tmp_path / "none")))
    assert _fence_events(missing) == (-1, -1)  # type: ignore[arg-type]
