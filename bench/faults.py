"""Fault benchmarks for the block manager: crash/SIGKILL recovery, injected retries, leases of
vanished clients, a bounded soak, journal cost, recovery time.

    python -m bench.faults all            # the full run (10-minute soak), prints the table
    python -m bench.faults all --quick    # a few seconds per section
    python -m bench.faults crash --kills 20 --fsync always
    python -m bench.faults retries | leases | soak --minutes 10 | fsync-cost | recovery
    python -m bench.faults serve [--tokens 400] [--concurrency 12]   # `pagedkv serve` through each fault
    python -m bench.faults serve --chaos [--seconds 60] [--seed N]   # seeded random faults, 12 clients

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

from bench.fault_scenarios.crash import run_crash
from bench.fault_scenarios.fsync_cost import run_fsync_cost
from bench.fault_scenarios.leases import run_leases, vanishing_client
from bench.fault_scenarios.model_client import ModelClient, client_main
from bench.fault_scenarios.recovery import run_recovery
from bench.fault_scenarios.retries import FaultInjector, run_retries
from bench.fault_scenarios.serve_faults import run_chaos, run_serve_faults
from bench.fault_scenarios.soak import run_soak

__all__ = [
    "run_serve_faults",
    "run_chaos",
    "run_crash",
    "run_retries",
    "run_leases",
    "run_soak",
    "run_fsync_cost",
    "run_recovery",
    "ModelClient",
    "FaultInjector",
    "print_report",
    "main",
]


def _table(title: str, header: str, rows: list[str]) -> None:
    """One report section: its title, a markdown table (header, separator, rows)."""
    out = sys.stdout.write
    out(f"\n## {title}\n\n")
    out(header + "\n" + "|" + "---|" * (header.count("|") - 1) + "\n")
    for row in rows:
        out(row + "\n")


def print_report(res: dict[str, Any]) -> None:
    if "serve" in res:
        rows = res["serve"]
        n = rows[0]["requests"] if rows else 0
        _table(
            f"`pagedkv serve` through faults ({n} concurrent streamed completions, greedy, ignore_eos; "
            "each fault ~1 s in; a killed role restarted 1 s later by a supervisor)",
            "| fault | completed | identical to fault-free | longest stall s | leaked blocks / sequences | "
            "later request | restarts |",
            [
                f"| {r['fault']} | {r['completed']} / {r['requests']} | {r['identical']} / {r['requests']} | "
                f"{r['longest_stall_s']:.2f} | {r['leaked_blocks']} / {r['leaked_sequences']} | "
                f"{'ok' if r['later_request_ok'] else 'FAILED'} | {', '.join(r['restarts']) or '-'} |"
                for r in rows
            ],
        )
        for r in rows:
            for e in r["errors"][:3]:
                sys.stdout.write(f"  {r['fault']}: {e}\n")
    if "chaos" in res:
        c = res["chaos"]
        _table(
            f"`pagedkv serve` chaos: a random fault every few seconds for {c['seconds']:.0f} s "
            f"({len(c['faults'])} faults, --seed {c['seed']}), clients sending request after request",
            "| requests | completed | identical to fault-free | longest stall s | "
            "leaked blocks / sequences | later request |",
            [
                f"| {c['requests']} | {c['completed']} | {c['identical']} | {c['longest_stall_s']:.2f} | "
                f"{c['leaked_blocks']} / {c['leaked_sequences']} | "
                f"{'ok' if c['later_request_ok'] else 'FAILED'} |"
            ],
        )
        sys.stdout.write("  " + c["schedule"] + "\n")
        sys.stdout.write("  faults: " + "; ".join(c["faults"]) + "\n")
        sys.stdout.write(
            f"  worker steps fenced (a paused or dead worker's unanswered step, its blocks held): "
            f"{c['fenced_steps']}, released: {c['fences_released']}\n"
        )
        sys.stdout.write("  restarts: " + ", ".join(c["restarts"]) + "\n")
        for e in c["errors"][:5]:
            sys.stdout.write(f"  {e}\n")
    for c in res.get("crash", []):
        _table(
            f"Crash: SIGKILL under load (--fsync {c['fsync']}, {c['wall_s']:.0f} s)",
            "| kills survived | acked ops | calls hit by a kill | verifications | acked ops lost | "
            "final pool (free+cached / total) | restart to SERVING median / max | replay max (records, KiB, "
            "ms) |",
            [
                f"| {c['restarts_ok']}/{c['kills']} | {c['acked_ops']} | {c['calls_hit_by_kill']} | "
                f"{c['verifications']} | {c['lost_or_mismatched']} | {c['final_free']}/{c['total_blocks']} "
                f"(used {c['final_used']}) | {c['restart_s_median']:.2f} / {c['restart_s_max']:.2f} s | "
                f"{c['replay_records_max']}, {c['replay_bytes_max'] / 1024:.0f}, "
                f"{c['replay_s_max'] * 1000:.1f} |"
            ],
        )
    if "recovery" in res:
        _table(
            "Recovery time vs journal size (65,536 blocks, up to 256 live sequences, in-process)",
            "| records | journal MiB | recovery s | µs/record | snapshot MiB | snapshot export ms |",
            [
                f"| {r['records']} | {r['journal_mib']:.2f} | {r['recovery_s']:.3f} | "
                f"{r['us_per_record']:.0f} | "
                f"{r['snapshot_mib']:.2f} | {r['snapshot_export_s'] * 1000:.1f} |"
                for r in res["recovery"]
            ],
        )
    if "fsync" in res:
        _table(
            "Cost per Append under each fsync policy (loopback, sync stub)",
            "| mode | p50 µs (1 in flight) | p99 µs | calls/s (8 in flight) | fsyncs | journal bytes/op |",
            [
                f"| {r['mode']} | {r['p50_us_1']:.0f} | {r['p99_us_1']:.0f} | {r['calls_s_concurrent']:.0f} "
                "| "
                f"{r['fsyncs']} | {r['bytes_per_op']:.0f} |"
                for r in res["fsync"]
            ],
        )
    if "retries" in res:
        r = res["retries"]
        _table(
            "Retries through injected UNAVAILABLE / DEADLINE_EXCEEDED",
            "| ops | dropped before server | dropped after server applied | dedupe hits | model mismatches | "
            "used blocks (server / model) | naive retries without request_id: double appends |",
            [
                f"| {r['ops']} | {r['injected_before']} | {r['injected_after']} | {r['dedupe_hits']} | "
                f"{r['problems']} | {r['used_blocks']} / {r['model_blocks']} | {r['naive_double_applied']} "
                "of 10 |"
            ],
        )
    if "leases" in res:
        r = res["leases"]
        _table(
            "Leases: clients SIGKILLed without Free",
            "| TTL s | sweep s | sequences alive (renewing) | after | leases expired | sequences freed | "
            "reclaimed after kill s |",
            [
                f"| {r['ttl_s']} | {r['sweep_s']} | {r['sequences_while_alive']} | {r['sequences_after']} | "
                f"{r['leases_expired']} | {r['sequences_expired']} | {r['reclaim_s']:.2f} |"
            ],
        )
    if "soak" in res:
        r = res["soak"]
        share = r["achieved_calls_s"] / r["peak_calls_s"] if r["peak_calls_s"] else 0.0
        _table(
            f"Soak ({r['seconds']:.0f} s, --fsync batch, request ids + leases)",
            "| peak calls/s | target (75%) | achieved | achieved / peak (goal ≥ 70%) | errors | "
            "RSS start → end KiB | pool after free-all |",
            [
                f"| {r['peak_calls_s']:.0f} | {r['target_calls_s']:.0f} | {r['achieved_calls_s']:.0f} | "
                f"{share:.0%} {'ok' if share >= 0.70 else 'MISS'} | {r['errors']} | "
                f"{r['rss_start_kib']} → {r['rss_end_kib']} | {r['free_after']}/{r['total_blocks']} free, "
                f"{r['sequences_after']} seqs |"
            ],
        )
        sys.stdout.write(f"\nRSS trace (s, KiB): {r['rss_trace']}\n")


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
    p.add_argument(
        "what", choices=("all", "crash", "retries", "leases", "soak", "fsync-cost", "recovery", "serve")
    )
    p.add_argument("--quick", action="store_true", help="small sizes (seconds per section)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--fsync", default=None, help="crash: one policy (default: all three)")
    p.add_argument("--minutes", type=float, default=10.0, help="soak duration")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument(
        "--tokens", type=int, default=400, help="serve: tokens per request (fewer for a quick run)"
    )
    p.add_argument("--concurrency", type=int, default=12, help="serve: concurrent requests")
    p.add_argument("--chaos", action="store_true", help="serve: random faults of every kind instead of rows")
    p.add_argument("--seconds", type=float, default=60.0, help="serve --chaos: how long")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="serve --chaos: seed of the fault schedule (drawn and printed before the run) [%(default)s]",
    )
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
    if a.what == "serve" and a.chaos:
        section(
            "chaos",
            lambda: run_chaos(seconds=a.seconds, tokens=a.tokens, concurrency=a.concurrency, seed=a.seed),
        )
    elif a.what == "serve":  # not part of "all": it loads a model into real workers
        section("serve", lambda: run_serve_faults(tokens=a.tokens, concurrency=a.concurrency))
    if a.what in ("all", "soak"):
        section(
            "soak", lambda: run_soak(seconds=10 if quick else a.minutes * 60, peak_window_s=2 if quick else 5)
        )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    bad = any(c["lost_or_mismatched"] or c["restarts_ok"] != c["kills"] for c in res.get("crash", []))
    bad |= bool(res.get("retries", {}).get("problems"))
    bad |= any(
        r["identical"] != r["requests"] or r["leaked_blocks"] or not r["later_request_ok"]
        for r in res.get("serve", [])
    )
    chaos = res.get("chaos")
    bad |= bool(chaos) and (
        chaos["identical"] != chaos["requests"] or chaos["leaked_blocks"] or not chaos["later_request_ok"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
