"""`pagedkv up`, `pagedkv generate` and `pagedkv demo` as a user runs them."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from pagedkv.ports import free_ports
from tests.frontend.up_process import UpProcess

ROOT = pathlib.Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PAGEDKV_KERNEL_BACKEND": "reference"}


def pagedkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        pathlib.Path(f"/proc/{pid}").exists()
        and "zombie" not in pathlib.Path(f"/proc/{pid}/status").read_text().lower()
    )


def test_generate_local_prints_json_and_is_deterministic() -> None:
    runs = [
        pagedkv("generate", "--token-ids", "5,6,7,8,9", "--max-tokens", "6", "--n", "2", "--local")
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second = (json.loads(r.stdout) for r in runs)
    assert first["completions"] == second["completions"]
    assert first["prompt_token_ids"] == [5, 6, 7, 8, 9]
    comps = first["completions"]
    assert [c["index"] for c in comps] == [0, 1]
    assert all(len(c["token_ids"]) == 6 and c["finish_reason"] == "length" for c in comps)
    assert comps[0]["token_ids"] == comps[1]["token_ids"]  # greedy: both samples agree
    assert first["request_id"] != second["request_id"]  # a fresh request id per call


def test_generate_reports_bad_input_and_a_missing_stack() -> None:
    r = pagedkv("generate", "--token-ids", "1,x")
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    r = pagedkv("generate", "--token-ids", "1", "--model", "/nope")
    assert r.returncode == 2 and "--model applies to --local" in r.stderr
    (port,) = free_ports(1)
    r = pagedkv("generate", "--token-ids", "1,2", "--block-manager", f"127.0.0.1:{port}", "--timeout-s", "2")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "pagedkv up" in r.stderr
    r = pagedkv("generate", "--token-ids", "1,2", "--url", f"http://127.0.0.1:{port}")
    assert r.returncode == 1 and "cannot reach" in r.stderr and "pagedkv up" in r.stderr


def test_up_serves_generate_and_stops_everything_on_ctrl_c(tmp_path: pathlib.Path) -> None:
    bm, ch, w, http = free_ports(4)
    args = ["--block-manager-port", str(bm), "--cache-host-port", str(ch), "--worker-port", str(w)]
    args += [
        "--num-workers",
        "2",
        "--num-gpu-blocks",
        "128",
        "--log-format",
        "json",
        "--serve-port",
        str(http),
    ]
    up = UpProcess(args, tmp_path, ENV)
    try:
        ready = up.wait_ready(120)
        assert ready.url == f"http://127.0.0.1:{http}" and ready.address("block-manager") == f"127.0.0.1:{bm}"
        pids = [s.pid for s in ready.services]
        assert len(pids) == 5 and all(pid_alive(p) for p in pids)  # + the OpenAI-compatible frontend
        up.wait_for(rf"OpenAI-compatible API at http://127\.0\.0\.1:{http}/v1")  # what a person reads
        workers = ",".join(ready.workers)
        assert workers == f"127.0.0.1:{w},127.0.0.1:{w + 1}"
        target = ["--block-manager", f"127.0.0.1:{bm}", "--workers", workers]
        # Several generate processes at once on one block manager: unique request ids and sequence ids,
        # all succeed.
        prompt = ",".join(str(t) for t in [3, 1, 4, 1, 5] * 8)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagedkv.cli",
                    "generate",
                    "--token-ids",
                    prompt,
                    "--max-tokens",
                    "5",
                    *target,
                ],
                cwd=ROOT,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        results = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in results]
        outs = [json.loads(out) for out, _ in results]
        assert len({o["request_id"] for o in outs}) == 3
        tokens = [o["completions"][0]["token_ids"] for o in outs]
        assert len(tokens[0]) == 5 and tokens == [tokens[0]] * 3  # same prompt, greedy: same output
        # Rejected inputs are refused before anything is allocated.
        for flag, value in (("--temperature", "-1"), ("--top-p", "2"), ("--top-k", "-3")):
            r = pagedkv("generate", "--token-ids", "1,2", flag, value, *target)
            assert r.returncode == 2 and flag in r.stderr and "is the stack running" not in r.stderr, r.stderr
        r = pagedkv("generate", "--token-ids", "1,,2", *target)
        assert r.returncode == 2 and "empty item" in r.stderr
        direct = outs[0]
        # The default: an HTTP client of the stack's `pagedkv serve`; same JSON, same greedy tokens.
        r = pagedkv(
            "generate",
            "--url",
            f"http://127.0.0.1:{http}",
            "--token-ids",
            prompt,
            "--max-tokens",
            "5",
            "--n",
            "2",
        )
        assert r.returncode == 0, r.stderr
        served = json.loads(r.stdout)
        assert set(served) == set(direct)
        assert [c["token_ids"] for c in served["completions"]] == [direct["completions"][0]["token_ids"]] * 2
        assert all(len(c["logprobs"]) == 5 for c in served["completions"])
        from pagedkv.frontend.clients.block_manager import BlockManagerClient

        with BlockManagerClient(f"127.0.0.1:{bm}") as client:
            stats = client.get_stats()
        assert stats.num_sequences == 0 and stats.num_used_blocks == 0, stats
    finally:
        rest = up.stop()
    assert up.p.returncode == 0, rest
    assert "nothing left running, no shared memory left behind" in rest
    assert not up.ready_file.exists()  # removed at stop: its presence means "serving now"
    assert not any(pid_alive(p) for p in pids)


def demo_figures(out: str) -> dict[str, str]:
    """{label: value} of the demo's results block."""
    block = out.split("pagedkv demo results", 1)[1]
    return {
        m.group(1).strip(): m.group(2).strip() for m in re.finditer(r"^  (\S.*?)\s{2,}(\S.*)$", block, re.M)
    }


def nums(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text)]


def test_demo_local_prints_the_figures() -> None:
    r = pagedkv("demo", "--local", "--requests", "12", "--no-progress", timeout=180)
    assert r.returncode == 0, r.stderr
    f = demo_figures(r.stdout)
    for label in (
        "throughput (generated)",
        "prefix-cache hit rate (prompt tokens)",
        "KV utilisation: live token slots / allocated slots (mean, min)",
        "preemptions (recompute, swap)",
        "peak KV memory, paged",
        "peak KV memory, contiguous reservation",
        "contiguous / paged",
        "block-manager round trips per iteration (Step)",
        "worker steps per iteration",
    ):
        assert label in f, (label, r.stdout)
    # Every figure is a number that means what its label says, and they agree with each other.
    assert nums(f["requests"]) == [12]
    prompt, generated = nums(f["prompt tokens / generated tokens"])
    assert prompt > 0 and generated > 0
    (wall,) = nums(f["wall time"])  # printed to 0.1 s
    assert wall > 0
    for label, tokens in (
        ("throughput (generated)", generated),
        ("throughput (prompt + generated)", prompt + generated),
    ):
        (tps,) = nums(f[label])
        assert tokens / (wall + 0.05) - 0.05 <= tps <= tokens / max(wall - 0.05, 1e-9) + 0.05, (
            label,
            tps,
            tokens,
            wall,
        )
    (hit,) = nums(f["prefix-cache hit rate (prompt tokens)"])
    assert 0 <= hit <= 100
    util_mean, util_min = nums(f["KV utilisation: live token slots / allocated slots (mean, min)"])
    assert 0 < util_min <= util_mean <= 100
    assert all(n >= 0 and n == int(n) for n in nums(f["preemptions (recompute, swap)"]))
    paged_mib, paged_blocks = nums(f["peak KV memory, paged"])
    contiguous_mib = nums(f["peak KV memory, contiguous reservation"])[0]
    assert paged_mib > 0 and paged_blocks > 0 and contiguous_mib > 0
    (ratio,) = nums(f["contiguous / paged"])
    assert abs(ratio - contiguous_mib / paged_mib) <= 0.006 + ratio * 0.005 / paged_mib * 2, (
        ratio,
        contiguous_mib,
        paged_mib,
    )
    (iterations,) = nums(f["engine iterations"])
    assert iterations > 0
    for label in ("block-manager round trips per iteration (Step)", "worker steps per iteration"):
        per, total = nums(f[label])
        assert total > 0 and abs(per - total / iterations) <= 0.005, (label, per, total, iterations)
    assert nums(f["block-manager round trips per iteration (Step)"])[0] <= 1.0, r.stdout


def test_roles_and_cpu_pinning_plan() -> None:
    import pytest

    from pagedkv.frontend.launch.config import StackConfig, worker_roles
    from pagedkv.frontend.launch.processes import plan, split_cpus

    assert worker_roles((), 2) == ["mixed", "mixed"]
    assert worker_roles(("decode",), 3) == ["decode"] * 3
    assert worker_roles(("prefill", "decode"), 2) == ["prefill", "decode"]
    with pytest.raises(ValueError, match="2 roles for 3 workers"):
        worker_roles(("prefill", "decode"), 3)
    with pytest.raises(ValueError, match="unknown worker role"):
        worker_roles(("both",), 1)
    assert split_cpus([0, 1], 2) == [[0], [1]] and split_cpus([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_cpus([0, 1], 3) == [[0], [1], [0]]
    services = plan(
        StackConfig(num_workers=2, roles=("prefill", "decode"), pin_workers=True, share_weights=False)
    )
    w0, w1 = services[2].args, services[3].args
    assert w0[w0.index("--role") + 1] == "prefill" and w1[w1.index("--role") + 1] == "decode"
    assert w0[w0.index("--num-threads") + 1] == str(len(split_cpus(sorted(os.sched_getaffinity(0)), 2)[0]))
    assert "--no-share-weights" in services[1].args


def test_one_stack_description_for_processes_and_in_process() -> None:
    """One StackConfig describes both stacks; the fields that once only the in-process stack had
    reach the processes as flags, and those flags parse as the settings."""
    from pagedkv.block_manager_svc.settings import load_settings
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.processes import plan
    from pagedkv.worker_svc.settings import WorkerSettings

    opts = StackConfig(
        seed=7,
        kernel_backend="reference",
        block_manager_overrides={"preemption_mode": "swap", "enable_prefix_caching": False},
    )
    bm, host, worker = plan(opts)[:3]
    settings = load_settings(bm.args[bm.args.index("block-manager") + 1 :])
    assert settings.preemption_mode == "swap" and settings.enable_prefix_caching is False
    assert host.args[host.args.index("--seed") + 1] == "7"
    w = worker.args
    assert w[w.index("--seed") + 1] == "7" and w[w.index("--kernel-backend") + 1] == "reference"
    assert WorkerSettings(kernel_backend=w[w.index("--kernel-backend") + 1]).kernel_backend == "reference"


def test_up_fsync_flag_reaches_the_block_manager_settings() -> None:
    """`pagedkv up --fsync` (default off: one host) becomes the block manager's journal fsync."""
    from pagedkv.block_manager_svc.settings import load_settings
    from pagedkv.frontend.launch.processes import build_parser, options_from_args, plan

    for argv, want in (([], "off"), (["--fsync", "always"], "always"), (["--fsync", "batch"], "batch")):
        opts = options_from_args(build_parser().parse_args(argv))
        bm = plan(opts, state_dir="/var/x")[0]
        settings = load_settings(bm.args[bm.args.index("block-manager") + 1 :])
        assert settings.fsync == want and settings.state_dir == "/var/x"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--fsync", "sometimes"])


def test_up_refuses_a_kv_cache_dtype_it_does_not_know() -> None:
    """`pagedkv up` itself refuses it (exit 2, naming the choices) before starting anything, not a
    block manager that exits later."""
    r = pagedkv("up", "--kv-cache-dtype", "bogus", "--print-plan")
    assert r.returncode == 2
    assert "--kv-cache-dtype" in r.stderr and "bogus" in r.stderr and "int8" in r.stderr
    assert "plan for" not in r.stdout


def test_up_forwards_the_frontend_flags_to_serve(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Served name, API key file, CORS origins and limits given to `pagedkv up` become the same
    `pagedkv serve` settings (parsed by serve's own loader); none given: serve's defaults."""
    from pagedkv.frontend.engine import EngineConfig
    from pagedkv.frontend.launch.processes import build_parser, options_from_args, plan
    from pagedkv.frontend.serve.settings import load_settings

    key = tmp_path / "key"
    key.write_text("k-0123456789\n")
    argv = [
        "--model-name", "smol", "--api-key-file", str(key), "--allowed-origins", "https://a.example",
        "--max-waiting", "7", "--max-num-seqs", "5", "--max-batch-tokens", "96",
        "--timeout-s", "90", "--block-manager-outage-s", "12.5", "--block-manager-timeout-s", "2.5",
        "--tool-call-parser", "hermes", "--step-transport", "grpc", "--decode-steps", "8",
    ]  # fmt: skip
    frontend = plan(options_from_args(build_parser().parse_args(argv)))[-1]
    assert frontend.name == "frontend"
    settings = load_settings(frontend.args[frontend.args.index("serve") + 1 :])
    assert settings.model_name == "smol" and settings.resolved_api_key() == "k-0123456789"
    assert settings.origins == ["https://a.example"]
    assert (settings.max_waiting, settings.max_num_seqs, settings.max_batch_tokens) == (7, 5, 96)
    assert (settings.timeout_s, settings.block_manager_outage_s) == (90.0, 12.5)
    assert settings.engine_config().block_manager_timeout_s == 2.5  # what the engine waits per call
    assert settings.tool_call_parser == "hermes"
    assert settings.step_transport == "grpc"
    assert settings.engine_config().decode_steps == 8
    assert "k-0123456789" not in " ".join(frontend.args)  # the key itself never on a command line
    plain = plan(options_from_args(build_parser().parse_args([])))[-1]
    default = load_settings(plain.args[plain.args.index("serve") + 1 :])
    assert (default.model_name, default.max_num_seqs, default.api_key_file) == ("", 64, "")
    assert default.engine_config().block_manager_timeout_s == EngineConfig().block_manager_timeout_s
    assert default.tool_call_parser == "auto"
    assert default.step_transport == "auto"
    assert default.engine_config().decode_steps == EngineConfig().decode_steps == 4
    for bad in (
        ["--max-num-seqs", "0"],
        ["--timeout-s", "0"],
        ["--block-manager-timeout-s", "0"],
        ["--api-key-file", str(tmp_path / "missing")],
        ["--tool-call-parser", "mistral"],
        ["--step-transport", "udp"],
        ["--decode-steps", "0"],
        ["--decode-steps", "65"],
    ):
        with pytest.raises(SystemExit) as e:
            options_from_args(build_parser().parse_args(bad))
        assert e.value.code == 2, bad  # a bad value, as argparse's own errors and a bad file's
        assert bad[0] in capsys.readouterr().err, bad


def _cpus_allowed(pid: int) -> set[int]:
    from pagedkv.cpu_list import parse_cpus

    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return set(parse_cpus(re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)))  # type: ignore[union-attr]


def test_the_default_stack_gives_workers_disjoint_cores_and_no_more_threads_than_cores(
    tmp_path: pathlib.Path,
) -> None:
    """`pagedkv up` with nothing but ports, as a user starts it: the plan it prints is the one it runs.
    Each worker is pinned to its own cores (the kernel's view, /proc), runs one compute thread per
    core it owns (its own `worker_ready` line and OMP_NUM_THREADS), and all of them together use no
    more cores than this process may."""
    from pagedkv.machine import this_machine
    from pagedkv.plan import compute_cpus

    bm, ch, w, http = free_ports(4)
    ports = ["--block-manager-port", str(bm), "--cache-host-port", str(ch), "--worker-port", str(w)]
    plan = pagedkv("up", "--print-plan", *ports)
    assert plan.returncode == 0, plan.stderr
    assert "plan for CPUs" in plan.stdout and "because:" in plan.stdout
    planned = re.findall(r"worker-\d+\s+cpu, cores (\S+) \(pinned\), (\d+) compute threads", plan.stdout)
    assert planned, plan.stdout
    logs = tmp_path / "logs"
    up = UpProcess(
        [*ports, "--serve-port", str(http), "--log-format", "json", "--log-dir", str(logs)], tmp_path, ENV
    )
    try:
        ready = up.wait_ready(120)
        up.wait_for(r"worker-0\s+cpu, cores")  # the plan in the ready output
        workers = [s for s in ready.services if s.name.startswith("worker-")]
        assert len(workers) == len(planned)
        cores = set(compute_cpus(this_machine(with_gpus=False)))
        seen: set[int] = set()
        total_threads = 0
        for svc in workers:
            allowed = _cpus_allowed(svc.pid)
            assert allowed <= cores and not allowed & seen, f"{svc.name} shares cores: {allowed} / {seen}"
            seen |= allowed
            environ = pathlib.Path(f"/proc/{svc.pid}/environ").read_bytes().split(b"\0")
            omp = next(e for e in environ if e.startswith(b"OMP_NUM_THREADS="))
            log = (logs / f"{svc.name}.log").read_text()
            ready_line = json.loads(next(line for line in log.splitlines() if '"worker_ready"' in line))
            assert ready_line["threads"] == int(omp.split(b"=")[1]) == len(allowed)
            assert sorted(ready_line["cpus"]) == sorted(allowed)
            total_threads += ready_line["threads"]
        assert total_threads <= len(cores)
        r = pagedkv("generate", "--url", ready.url, "--token-ids", "1,2,3", "--max-tokens", "4")
        assert r.returncode == 0, r.stderr
    finally:
        up.stop()


def test_up_plans_oversubscription_down_and_refuses_what_cannot_run() -> None:
    ncpu = len(os.sched_getaffinity(0))
    r = pagedkv("up", "--print-plan", "--num-workers", str(ncpu + 2))
    assert r.returncode == 0, r.stderr
    assert f"--num-workers {ncpu + 2} on {ncpu} cores" in r.stdout
    assert len(re.findall(r"^\s+worker-\d+", r.stdout, re.M)) == ncpu
    r = pagedkv("up", "--print-plan", "--num-workers", "0")
    assert r.returncode != 0 and "--num-workers must be at least 1" in r.stderr
    r = pagedkv("up", "--print-plan", "--kv-cache-memory", "0.000001")
    assert r.returncode != 0 and "KV cache would hold 0 blocks" in r.stderr
