"""Fault benchmarks for the block manager: crash/SIGKILL recovery, injected retries, leases of
vanished clients, a bounded soak, journal cost, recovery time.

    python bench/faults.py all            # the full run (10-minute soak), prints the table
    python bench/faults.py all --quick    # a few seconds per section
    python bench/faults.py crash --kills 20 --fsync always
    python bench/faults.py retries | leases | soak --minutes 10 | fsync-cost | recovery

This file is the CLI and the table; each scenario is a module of ``bench/fault_scenarios/`` over
the shared process helpers there (``processes.py``). The same functions run (with small sizes) in
tests/block_manager_svc/reliability. Everything listens on 127.0.0.1 only and every phase is
bounded in time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.fault_scenarios.crash import run_crash  # noqa: E402
from bench.fault_scenarios.fsync_cost import run_fsync_cost  # noqa: E402
from bench.fault_scenarios.leases import vanishing_client, run_leases  # noqa: E402
from bench.fault_scenarios.model_client import ModelClient, client_main  # noqa: E402
from bench.fault_scenarios.recovery import run_recovery  # noqa: E402
from bench.fault_scenarios.retries import FaultInjector, run_retries  # noqa: E402
from bench.fault_scenarios.soak import run_soak  # noqa: E402

__all__ = ["run_crash", "run_retries", "run_leases", "run_soak", "run_fsync_cost", "run_recovery",
           "ModelClient", "FaultInjector", "print_report", "main"]


def print_report(res: dict[str, Any]) -> None:
    out = sys.stdout.write
    for c in res.get("crash", []):
        out(f"\n## Crash: SIGKILL under load (--fsync {c['fsync']}, {c['wall_s']:.0f} s)\n\n")
        out("| kills survived | acked ops | calls hit by a kill | verifications | acked ops lost | "
            "final pool (free+cached / total) | restart to SERVING median / max | replay max (records, KiB, ms) |\n")
        out("|---|---|---|---|---|---|---|---|\n")
        out(f"| {c['restarts_ok']}/{c['kills']} | {c['acked_ops']} | {c['calls_hit_by_kill']} | {c['verifications']} | "
            f"{c['lost_or_mismatched']} | {c['final_free']}/{c['total_blocks']} (used {c['final_used']}) | "
            f"{c['restart_s_median']:.2f} / {c['restart_s_max']:.2f} s | "
            f"{c['replay_records_max']}, {c['replay_bytes_max'] / 1024:.0f}, {c['replay_s_max'] * 1000:.1f} |\n")
    if "recovery" in res:
        out("\n## Recovery time vs journal size (65,536 blocks, up to 256 live sequences, in-process)\n\n")
        out("| records | journal MiB | recovery s | µs/record | snapshot MiB | snapshot export ms |\n|---|---|---|---|---|---|\n")
        for r in res["recovery"]:
            out(f"| {r['records']} | {r['journal_mib']:.2f} | {r['recovery_s']:.3f} | {r['us_per_record']:.0f} | "
                f"{r['snapshot_mib']:.2f} | {r['snapshot_export_s'] * 1000:.1f} |\n")
    if "fsync" in res:
        out("\n## Cost per Append under each fsync policy (loopback, sync stub)\n\n")
        out("| mode | p50 µs (1 in flight) | p99 µs | calls/s (8 in flight) | fsyncs | journal bytes/op |\n"
            "|---|---|---|---|---|---|\n")
        for r in res["fsync"]:
            out(f"| {r['mode']} | {r['p50_us_1']:.0f} | {r['p99_us_1']:.0f} | {r['calls_s_concurrent']:.0f} | "
                f"{r['fsyncs']} | {r['bytes_per_op']:.0f} |\n")
    if "retries" in res:
        r = res["retries"]
        out("\n## Retries through injected UNAVAILABLE / DEADLINE_EXCEEDED\n\n")
        out("| ops | dropped before server | dropped after server applied | dedupe hits | model mismatches | "
            "used blocks (server / model) | naive retries without request_id: double appends |\n|---|---|---|---|---|---|---|\n")
        out(f"| {r['ops']} | {r['injected_before']} | {r['injected_after']} | {r['dedupe_hits']} | {r['problems']} | "
            f"{r['used_blocks']} / {r['model_blocks']} | {r['naive_double_applied']} of 10 |\n")
    if "leases" in res:
        r = res["leases"]
        out("\n## Leases: clients SIGKILLed without Free\n\n")
        out("| TTL s | sweep s | sequences alive (renewing) | after | leases expired | sequences freed | "
            "reclaimed after kill s |\n|---|---|---|---|---|---|---|\n")
        out(f"| {r['ttl_s']} | {r['sweep_s']} | {r['sequences_while_alive']} | {r['sequences_after']} | "
            f"{r['leases_expired']} | {r['sequences_expired']} | {r['reclaim_s']:.2f} |\n")
    if "soak" in res:
        r = res["soak"]
        out(f"\n## Soak ({r['seconds']:.0f} s, --fsync batch, request ids + leases)\n\n")
        out("| peak calls/s | target (75%) | achieved | achieved / peak (goal ≥ 70%) | errors | "
            "RSS start → end KiB | pool after free-all |\n|---|---|---|---|---|---|---|\n")
        share = r["achieved_calls_s"] / r["peak_calls_s"] if r["peak_calls_s"] else 0.0
        out(f"| {r['peak_calls_s']:.0f} | {r['target_calls_s']:.0f} | {r['achieved_calls_s']:.0f} | "
            f"{share:.0%} {'ok' if share >= 0.70 else 'MISS'} | {r['errors']} | "
            f"{r['rss_start_kib']} → {r['rss_end_kib']} | {r['free_after']}/{r['total_blocks']} free, "
            f"{r['sequences_after']} seqs |\n")
        out(f"\nRSS trace (s, KiB): {r['rss_trace']}\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    if argv and argv[0] == "vanish":
        p = argparse.ArgumentParser()
        p.add_argument("--port", type=int)
        p.add_argument("--lease")
        p.add_argument("--n", type=int)
        a = p.parse_args(argv[1:])
        vanishing_client(a.port, a.lease, a.n)
        return 0
    from pagedkv.logging_setup import configure_logging

    configure_logging("warning", "console")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("all", "crash", "retries", "leases", "soak", "fsync-cost", "recovery"))
    p.add_argument("--quick", action="store_true", help="small sizes (seconds per section)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--fsync", default=None, help="crash: one policy (default: all three)")
    p.add_argument("--minutes", type=float, default=10.0, help="soak duration")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    res: dict[str, Any] = {}
    quick = a.quick

    def section(key: str, fn: Callable[[], Any]) -> None:
        res[key] = fn()
        print_report({key: res[key]})  # as soon as it is measured
        sys.stdout.flush()
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))

    if a.what in ("all", "crash"):
        policies = [a.fsync] if a.fsync else ["always", "batch", "off"]
        section("crash", lambda: [run_crash(kills=a.kills, fsync=f) for f in policies])
    if a.what in ("all", "recovery"):
        section("recovery", lambda: run_recovery((500, 2000) if quick else (1000, 10000, 50000)))
    if a.what in ("all", "fsync-cost"):
        section("fsync", lambda: run_fsync_cost(400 if quick else 4000))
    if a.what in ("all", "retries"):
        section("retries", lambda: run_retries(ops=100 if quick else 500))
    if a.what in ("all", "leases"):
        section("leases", run_leases)
    if a.what in ("all", "soak"):
        section("soak", lambda: run_soak(seconds=10 if quick else a.minutes * 60, peak_window_s=2 if quick else 5))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    bad = any(c["lost_or_mismatched"] or c["restarts_ok"] != c["kills"] for c in res.get("crash", []))
    bad |= bool(res.get("retries", {}).get("problems"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
