"""bench/gpu/pd_check.py's short form (what gpu_check.sh's pd section runs) fits its budget by design.

The old short form still passed --overlap (six stacks, each loading a 2.2 GB fp32 checkpoint). The
short form: a small model, two layouts, no --overlap; the full form keeps all of them.
"""

from __future__ import annotations

from bench.gpu import pd_check


def _opt(args: list[str], name: str) -> str:
    return args[len(args) - 1 - args[::-1].index(name) + 1]  # the last value wins, as in argparse


def test_short_form_is_small_two_layouts_and_no_overlap() -> None:
    args = pd_check.pd_args(["--short"])
    assert "--overlap" not in args and "--short" not in args
    assert _opt(args, "--layouts").split(",") == ["mixed", "prefill+decode"]
    hidden, layers, vocab = (
        int(_opt(args, "--hidden")),
        int(_opt(args, "--layers")),
        int(_opt(args, "--vocab")),
    )
    params = layers * 12 * hidden * hidden + 2 * vocab * hidden  # Llama-shaped: about 12 h^2 per layer
    assert params * 4 < 100e6, "the short form's fp32 checkpoint must stay under 100 MB"
    assert _opt(args, "--device") == "cuda"


def test_full_form_keeps_every_layout_and_overlap_and_extra_args_override() -> None:
    full = pd_check.pd_args([])
    assert "--overlap" in full and "--layouts" not in full and int(_opt(full, "--hidden")) == 2048
    rehearse = pd_check.pd_args(["--short", "--device", "cpu"])
    assert _opt(rehearse, "--device") == "cpu"
