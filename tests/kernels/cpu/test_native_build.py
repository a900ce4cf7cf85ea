"""The native CPU kernels as installed: variants built by setup.py and chosen by CPU features, the
torch fallback when none was built, argument checks that raise, the torch ops, and the decode
kernel's GQA copies for groups 3, 5, 6 and 7 at head_dim 64.

Every tensor here is made on the CPU (the kernels are CPU kernels, also on a GPU machine).
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from pagedkv.kernels import reference
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native
from tests.kernels import cases
from tests.kernels.cases import PagedCache, assert_close, make_paged, poisoned_like

ROOT = pathlib.Path(__file__).resolve().parents[3]
X86 = platform.machine().lower() in ("x86_64", "amd64")
COMPILER = shutil.which("cc") or shutil.which("gcc")


def _paged(
    lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> PagedCache:
    """A case on CPU tensors, also where ``cases.DEVICE`` is another device (the GPU image, or its
    rehearsal's meta device): some cases are built at collection, before any fixture runs."""
    saved, cases.DEVICE = cases.DEVICE, torch.device("cpu")
    try:
        return make_paged(lens, block_size, kv_heads, head_dim, dtype, seed)
    finally:
        cases.DEVICE = saved


def _query(n: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, heads, head_dim), generator=gen).to(dtype)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the loaded library: the next call chooses (and loads) a variant again. monkeypatch
    puts the loaded one back after the test."""
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_variant", None)
    monkeypatch.setattr(cpu_native, "_tried", False)


needs_native = pytest.mark.skipif(
    not cpu_native.available(), reason="the native kernels were not built at install"
)


# --- built at install, chosen by CPU features ---------------------------------------------------------


def _installed() -> bool:
    try:
        importlib.metadata.distribution("pagedkv")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(COMPILER is None, reason="no C compiler: the install legitimately built nothing")
@pytest.mark.skipif(not _installed(), reason="a source tree that was never installed (nothing built it)")
def test_the_install_built_every_variant_of_this_architecture() -> None:
    """With a C compiler present (CI, the image), the package build must have produced the kernels;
    an install that silently fell back to torch would pass every other test here by skipping."""
    want = ["avx512", "avx2", "x86_64"] if X86 else ["generic"]
    assert cpu_native.built_variants() == want, "reinstall (make install / pip install .) with gcc present"
    for name in want:
        path = cpu_native.artifact(name)
        assert path is not None and path.is_file() and path.parent.name == "cpu"


@needs_native
def test_the_best_variant_the_cpu_runs_is_loaded() -> None:
    level = cpu_native.cpu_level()
    assert level in (0, 1, 2)
    if X86:
        flags = set()
        cpuinfo = pathlib.Path("/proc/cpuinfo")
        if cpuinfo.exists():
            line = next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags"))
            flags = set(line.split(":", 1)[1].split())
            has512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"} <= flags
            assert level == (2 if has512 else 1 if {"avx2", "fma"} <= flags else 0)
    best = cpu_native.choose_variant(cpu_native.built_variants(), level, "auto")
    assert cpu_native.active_variant() == best
    assert cpu_native.kernel_path() == f"native-{best}"


def test_choose_variant_rules() -> None:
    built = ["avx512", "avx2", "x86_64"]
    assert cpu_native.choose_variant(built, 2, "auto") == "avx512"
    assert cpu_native.choose_variant(built, 1, "auto") == "avx2"
    assert cpu_native.choose_variant(built, 0, "auto") == "x86_64"
    assert cpu_native.choose_variant(["x86_64"], 2, "auto") == "x86_64"
    assert cpu_native.choose_variant(built, 2, "avx2") == "avx2"
    with pytest.raises(OSError, match="cannot run"):
        cpu_native.choose_variant(built, 1, "avx512")
    with pytest.raises(OSError, match="not built"):
        cpu_native.choose_variant(["x86_64"], 2, "avx2")
    with pytest.raises(OSError, match="not built at install"):
        cpu_native.choose_variant([], 2, "auto")
    with pytest.raises(OSError, match="sse9"):
        cpu_native.choose_variant(built, 2, "sse9")


@needs_native
@pytest.mark.parametrize("variant", list(cpu_native.VARIANTS))
def test_each_variant_matches_the_reference(
    variant: str, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if variant not in cpu_native.built_variants():
        pytest.skip(f"{variant} is not built on this architecture")
    if cpu_native.VARIANTS[variant] > cpu_native.cpu_level():
        pytest.skip(f"this CPU cannot run {variant}")
    monkeypatch.setenv(cpu_native.ENV_SWITCH, variant)
    assert cpu_native.kernel_path() == f"native-{variant}"
    for dtype in (torch.float32, torch.bfloat16):
        case = _paged([1, 16, 17, 250, 0, 77], 16, 2, 64, dtype, seed=11)
        q = _query(6, 8, 64, dtype, seed=12)
        got = cpu_native.decode(
            q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, poisoned_like(q)
        )
        want = reference.paged_decode_attention(
            q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
        )
        assert_close(got, want, dtype)
    logits = torch.randn(7, 5000, generator=torch.Generator().manual_seed(13)) * 10
    torch.testing.assert_close(
        cpu_native.logsumexp_rows(logits), torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-5
    )


@needs_native
def test_a_forced_variant_the_cpu_cannot_run_falls_back_to_torch(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_native, "cpu_level", lambda: 0)  # a CPU without AVX2
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "avx2" if X86 else "avx512")
    assert not cpu_native.available() and cpu_native.kernel_path() == "torch"


def test_building_without_a_compiler_succeeds_and_builds_nothing(tmp_path: pathlib.Path) -> None:
    """What `pip install .` runs for the kernels (setup.py build_ext), with no usable C compiler:
    every variant is optional, so the build succeeds and installs no library."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "LDSHARED": str(tmp_path / "no-such-cc -shared")}
    done = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "tmp"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((tmp_path / "lib").rglob("*.so"))
    assert "no-such-cc" in done.stderr + done.stdout  # the failure is reported, not hidden


def test_artifact_missing_keeps_the_torch_path(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without a compiler: no library found, the CPU backend's buckets + SDPA and
    torch.logsumexp run, WorkerInfo says torch, and calling the op directly says why it cannot."""
    monkeypatch.setattr(cpu_native, "artifact", lambda variant: None)
    monkeypatch.delenv(cpu_native.ENV_SWITCH, raising=False)
    assert not cpu_native.available() and cpu_native.kernel_path() == "torch"
    case = _paged([40, 300, 3], 16, 3, 64, torch.float32, seed=5)
    plan = cpu.plan_decode(case.block_tables, case.seq_lens, 16)
    assert plan.native_tables is None and plan.bucketed
    q = _query(3, 9, 64, torch.float32, seed=6)
    got = cpu.paged_decode_attention(
        q,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        0.125,
        out=poisoned_like(q),
        plan=plan,
    )
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    assert_close(got, want, torch.float32)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_native.logsumexp_rows(logits), torch.logsumexp(logits, -1))
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_native.decode(
            q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, poisoned_like(q)
        )


# --- argument checks -----------------------------------------------------------------------------------


def _good() -> dict[str, torch.Tensor]:
    case = _paged([20, 33], 16, 2, 64, torch.float32, seed=3)
    q = _query(2, 6, 64, torch.float32, seed=4)
    return {
        "query": q,
        "key_cache": case.key_cache,
        "value_cache": case.value_cache,
        "block_tables": case.block_tables,
        "seq_lens": case.seq_lens,
        "out": poisoned_like(q),
    }


def _bad_cases() -> list[tuple[str, str, object]]:
    g = _good()
    return [
        ("query", "device meta", g["query"].to("meta")),
        ("key_cache", "device meta", g["key_cache"].to("meta")),
        ("out", "device meta", g["out"].to("meta")),
        ("block_tables", "device meta", g["block_tables"].to("meta")),
        ("query", "dtype", g["query"].half()),
        ("key_cache", "dtype", g["key_cache"].double()),
        ("value_cache", "dtype", g["value_cache"].bfloat16()),
        ("block_tables", "dtype", g["block_tables"].long()),
        ("seq_lens", "dtype", g["seq_lens"].long()),
        ("out", "dtype", g["out"].bfloat16()),
        ("query", "contiguous", torch.randn(2, 6, 128)[:, :, ::2]),
        ("key_cache", "contiguous", torch.randn(*g["key_cache"].shape[:3], 128)[..., ::2]),
        ("block_tables", "contiguous", g["block_tables"].t().contiguous().t()),
        ("query", "dimensions", g["query"][0]),
        ("key_cache", "head_dim", g["key_cache"][..., :32].contiguous()),
        ("value_cache", "shape", g["value_cache"][:-1]),
        ("query", "multiple", _query(2, 5, 64, torch.float32, 1)),
        ("seq_lens", "rows", g["seq_lens"][:1]),
        ("out", "shape", torch.empty(2, 6, 32)),
        ("query", "torch.Tensor", [[0.0]]),
    ]


@pytest.mark.parametrize(
    ("name", "words", "bad"),
    _bad_cases(),
    ids=[f"{n}-{w.replace(' ', '_').replace('.', '_')}" for n, w, _ in _bad_cases()],
)
def test_decode_rejects_what_the_kernel_cannot_index(name: str, words: str, bad: object) -> None:
    """Each wrong argument raises naming it, before any memory is touched: the output stays poisoned.
    Meta tensors stand in for device tensors (their data pointer is not host memory)."""
    args = _good()
    out = args["out"]
    args[name] = bad  # type: ignore[assignment]
    err = TypeError if words == "torch.Tensor" else ValueError
    with pytest.raises(err, match=name) as info:
        cpu_native.check_decode(**args)  # type: ignore[arg-type]
    assert words in str(info.value)
    if cpu_native.available():
        # Through the op: a non-tensor is refused by torch's dispatcher (the schema), naming it too.
        via_op = err if isinstance(bad, torch.Tensor) else RuntimeError
        with pytest.raises(via_op, match=name):
            cpu_native.decode(
                args["query"],
                args["key_cache"],
                args["value_cache"],
                args["block_tables"],
                args["seq_lens"],
                0.125,
                args["out"],
            )
        assert torch.isnan(out).all()


@needs_native
def test_fake_cuda_tensors_are_refused_without_reading_them() -> None:
    """CUDA tensors (fake ones: no GPU needed) get a ValueError naming the argument from the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = _good()
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in g.items()}
        try:
            fake["query"] = torch.empty(2, 6, 64, device="cuda")
        except (RuntimeError, AssertionError) as exc:
            pytest.skip(f"fake CUDA tensors unavailable in this torch build: {exc}")
        with pytest.raises(ValueError, match="query must be a CPU tensor"):
            torch.ops.pagedkv.paged_decode(
                fake["query"],
                fake["key_cache"],
                fake["value_cache"],
                fake["block_tables"],
                fake["seq_lens"],
                0.125,
                fake["out"],
            )


def test_logsumexp_rejects_what_the_kernel_cannot_read() -> None:
    for bad, words in (
        (torch.randn(3, 4).to("meta"), "device meta"),
        (torch.randn(3, 4).double(), "dtype"),
        (torch.randn(3, 4, 2), "dimensions"),
        (torch.randn(4, 3).t(), "contiguous"),
        (torch.empty(3, 0), "column"),
    ):
        with pytest.raises(ValueError, match="logits") as info:
            cpu_native.check_logsumexp(bad)
        assert words in str(info.value)
    with pytest.raises(ValueError, match="logits"):
        torch.ops.pagedkv.logsumexp_rows(torch.randn(3, 4).double())
    with pytest.raises(ValueError, match="logits"):
        torch.ops.pagedkv.logsumexp_argmax_rows(torch.randn(4, 3).t())


# --- torch ops ----------------------------------------------------------------------------------------


@needs_native
def test_ops_run_by_name_and_show_in_the_profiler() -> None:
    g = _good()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.pagedkv.paged_decode(
            g["query"], g["key_cache"], g["value_cache"], g["block_tables"], g["seq_lens"], 0.125, g["out"]
        )
        lse = torch.ops.pagedkv.logsumexp_rows(g["query"][0])
    names = {e.key for e in prof.key_averages()}
    assert {"pagedkv::paged_decode", "pagedkv::logsumexp_rows"} <= names, sorted(names)
    want = reference.paged_decode_attention(
        g["query"], g["key_cache"], g["value_cache"], g["block_tables"], g["seq_lens"], 0.125
    )
    assert_close(g["out"], want, torch.float32)
    torch.testing.assert_close(lse, torch.logsumexp(g["query"][0], -1))


@needs_native
@pytest.mark.skipif(
    "cases.PRETENDED_CUDA",
    reason="opcheck saves the CUDA RNG state: the GPU-image rehearsal only pretends CUDA",
)
def test_ops_pass_torch_library_opcheck() -> None:
    """Schema, fake implementation and the tracing paths torch.compile uses (opcheck)."""
    g = _good()
    torch.library.opcheck(
        torch.ops.pagedkv.paged_decode.default,
        (g["query"], g["key_cache"], g["value_cache"], g["block_tables"], g["seq_lens"], 0.125, g["out"]),
    )
    torch.library.opcheck(torch.ops.pagedkv.logsumexp_rows.default, (torch.randn(5, 300),))
    torch.library.opcheck(torch.ops.pagedkv.logsumexp_argmax_rows.default, (torch.randn(5, 300),))


@needs_native
@pytest.mark.skipif(
    "cases.PRETENDED_CUDA", reason="dynamo asks the CUDA runtime: the GPU-image rehearsal only pretends CUDA"
)
def test_ops_compose_with_torch_compile() -> None:
    g = _good()

    def step(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        cpu_native.decode(
            q * 2.0, g["key_cache"], g["value_cache"], g["block_tables"], g["seq_lens"], 0.125, out
        )
        return out + cpu_native.logsumexp_rows(out.flatten(1))[:, None, None]

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(g["query"], poisoned_like(g["query"]))
    want = step(g["query"], poisoned_like(g["query"]))
    torch.testing.assert_close(got, want)


# --- GQA groups 3, 5, 6, 7 at head_dim 64 -------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [3, 5, 6, 7])
def test_odd_gqa_groups_match_the_reference_on_both_copies(group: int, dtype: torch.dtype) -> None:
    """SmolLM2's 9 query heads over 3 KV heads (group 3), and groups 5-7: the specialised copy and
    the generic one against the reference, fresh random inputs, NaN-poisoned outputs, ragged lengths
    around the sixteen-key chunks, a zero-length row."""
    kv_heads = 3
    case = _paged(
        [1, 15, 16, 17, 161, 0, 333], 16, kv_heads, 64, dtype, seed=group * 10 + (dtype == torch.float32)
    )
    q = _query(7, group * kv_heads, 64, dtype, seed=group)
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    special = cpu_native.decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, poisoned_like(q)
    )
    generic = cpu_native.decode_generic_for_bench(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, poisoned_like(q)
    )
    assert_close(special, want, dtype)
    assert_close(generic, want, dtype)
    assert torch.equal(special[5], torch.zeros_like(special[5]))
