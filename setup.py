"""Builds the native CPU kernels (kernels/cpu/csrc/) at install time; everything else is in pyproject.toml.

Why here and not on a server's first request: a worker should not need a C compiler at run time,
nor spend its first step compiling. One shared library per instruction-set variant is built (x86-64:
baseline, AVX2 + FMA, AVX-512; any other machine: one generic build), and kernels/cpu/native.py
loads the best one the running CPU supports. They are plain C libraries called through ctypes (no
Python or torch headers: they build in seconds and need neither python3-dev nor torch at build
time); setuptools' ``Extension`` only compiles and installs them.

Every variant is ``optional``: without a C compiler (or with one that lacks OpenMP or a variant's
flags) the install still succeeds, without that variant, and the kernels fall back to torch
(docs/kernels.md, "CPU backend").
"""

from __future__ import annotations

import copy
import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [
    "kernels/cpu/csrc/paged_decode.c",
    "kernels/cpu/csrc/paged_prefill.c",
    "kernels/cpu/csrc/logsumexp.c",
    "kernels/cpu/csrc/layer_ops.c",
    "kernels/cpu/csrc/linear.c",
    "kernels/cpu/csrc/quant_linear.c",
    "kernels/cpu/csrc/decode_layers.c",
    "kernels/cpu/csrc/read_spans.c",
    "kernels/cpu/csrc/cpu_features.c",
]
DEPENDS = [
    "kernels/cpu/csrc/fastexp.h",
    "kernels/cpu/csrc/vector_width.h",
    "kernels/cpu/csrc/decode_args.h",
    "kernels/cpu/csrc/linear_panel.h",
]
# -fno-trapping-math: the kernels never enable floating-point traps, and without this flag GCC keeps
# any loop with a select in it (a clamp, a sign test) scalar, fastexp.h's exp among them: the
# sampling's log-sum-exp, SiLU and the prefill's softmax. It changes no value (clang's default);
# what it allows is evaluating both sides of a select.
COMMON = ["-O3", "-std=gnu11", "-fopenmp", "-fno-strict-aliasing", "-fno-trapping-math", "-Wno-psabi"]

# variant -> compiler flags. Names must match kernels/cpu/native.py's VARIANTS.
X86_VARIANTS = {
    "x86_64": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "avx512": [
        "-march=x86-64",
        "-mtune=generic",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mbmi2",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
    ],
}
GENERIC_VARIANTS = {"generic": []}


def _variants() -> dict[str, list[str]]:
    machine = os.environ.get("PAGEDKV_BUILD_MACHINE", platform.machine()).lower()
    return X86_VARIANTS if machine in ("x86_64", "amd64") else GENERIC_VARIANTS


class BuildNative(build_ext):
    """One temporary directory per extension (the variants compile the same sources with different
    flags, and shared object files would be overwritten or reused between them), all built at once."""

    def finalize_options(self) -> None:
        super().finalize_options()
        # The variants are independent compiles: build them side by side, one per core.
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        # A shallow copy with its own build_temp: the variants build on threads side by side.
        own = copy.copy(self)
        own.build_temp = os.path.join(self.build_temp, ext.name)
        super(BuildNative, own).build_extension(ext)


setup(
    ext_modules=[
        Extension(
            f"pagedkv.kernels.cpu._native_{name}",
            sources=SOURCES,
            depends=DEPENDS,
            extra_compile_args=COMMON + flags,
            extra_link_args=["-fopenmp"],
            optional=True,
        )
        for name, flags in _variants().items()
    ],
    cmdclass={"build_ext": BuildNative},
)
