"""bench/faults.py serve's gray rows and a killed worker, CI-sized, on the stack `pagedkv up --model`
plans for this machine (one worker on a small one: its requests wait for the restarted worker):
every role a real process, `pagedkv serve` in front, 4 streamed completions in flight when each
fault hits: SIGKILL of a worker, SIGSTOP of the block manager, the cache host
and one worker (3 s, then SIGCONT), the serve -> block-manager link black-holed for 3 s, and (as
root) the block manager's journal tmpfs full for 2 s. Each: every request completes with the
fault-free tokens, nothing stays allocated, a later request succeeds, and nothing was restarted
(hung is not dead).

The workers watch their cache host every 0.5 s, so a 3 s pause is six missed checks: before hung was
told from dead, the host was declared lost and the requests waited for a new instance that never came.
The full-size rows (8 s pauses, 10 s link, 5 s disk, 12 clients) and the chaos mode are
`python -m bench.faults serve [--chaos]`."""

from __future__ import annotations

import pytest

from bench.fault_scenarios.serve_faults import StateDisk, fault_names, run_serve_faults


def test_gray_faults_and_a_killed_worker_under_serve_lose_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # The processes inherit the environment: the plain-torch kernels, not the Triton interpreter
    # tests/conftest.py selects for this process.
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    names = fault_names(pause_s=3, blackhole_s=3, enospc_s=2)
    gray = tuple(n for n in names if "SIGSTOP" in n or "black-holed" in n or "ENOSPC" in n)
    rows = run_serve_faults(
        tokens=200,
        concurrency=4,
        fault_after_s=0.5,
        faults=("none", "a worker SIGKILL", *gray),
        pause_s=3,
        blackhole_s=3,
        enospc_s=2,
        worker_args=("--cache-host-check-interval-s", "0.5"),
    )
    expected = len(gray) + 2 if StateDisk.possible() else len(gray) + 1  # the disk row needs root
    assert [r["fault"] for r in rows][:2] == ["none", "a worker SIGKILL"] and len(rows) == expected
    for r in rows:
        assert r["in_flight_at_fault"] == r["requests"], r  # the fault hit mid-generation
        assert (r["completed"], r["identical"]) == (r["requests"], r["requests"]), r
        assert (r["leaked_blocks"], r["leaked_sequences"]) == (0, 0), r
        assert r["later_request_ok"], r
        if r["fault"] == "a worker SIGKILL":  # dead: the supervisor restarted it, whatever the plan
            assert any(x.startswith("worker-0") for x in r["restarts"]), r
        else:
            assert r["restarts"] == [], r  # hung is not dead
    assert rows[0]["supervisor_errors"] == []
