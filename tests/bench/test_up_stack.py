"""bench/up_stack.py: the stack a benchmark starts is the one `pagedkv up` runs with the same flags,
only listening on other ports, logging elsewhere and with a shared-memory prefix of its own."""

from __future__ import annotations

from pathlib import Path

from bench import up_stack
from pagedkv.frontend.launch.processes import up_config


def test_the_default_is_up_with_no_flags_and_a_tuned_row_is_named_by_its_flags(tmp_path: Path) -> None:
    opts = up_stack.up_options(None, log_dir=str(tmp_path), shm_prefix="pagedkv-test-upstack")
    assert up_stack.comparable(opts) == up_stack.comparable(up_config([]))
    assert opts.log_dir == str(tmp_path) and opts.log_format == "json"
    assert opts.shm_prefix == "pagedkv-test-upstack"
    ports = [opts.block_manager_port, opts.cache_host_port, opts.worker_port]
    assert ports == list(range(ports[0], ports[0] + 3)) and opts.serve_port == ports[2] + opts.num_workers
    assert up_stack.label(()) == up_stack.DEFAULT_LABEL == "pagedkv (default)"

    flags = ["--num-workers", "2", "--no-pin-workers"]
    tuned = up_stack.up_options(None, flags)
    assert up_stack.comparable(tuned) == up_stack.comparable(up_config(flags))
    assert up_stack.label(flags) == "pagedkv --num-workers 2 --no-pin-workers"
    assert up_stack.compute_cpus(tuned) == "" and "unpinned" in up_stack.describe(tuned)
    # the peer's threads: what the default plan computes with
    assert up_stack.compute_threads(opts) == sum(w.threads for w in up_config([]).placement)
