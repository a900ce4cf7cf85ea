"""GGUF K-quant blocks for tests: Q4_K and Q6_K super-blocks made from given fp32 weights, written
here from the block layouts (the gguf package dequantizes them but cannot quantize to them).

Why a quantizer and not only random bytes: a model whose matrices are random blocks has weights
unrelated to any trained or random model (a Q4_K block's minimums shift every weight of its
sub-block), and greedy decoding on them tends to repeat one token, a weak oracle. Quantizing a
random Hugging Face model's weights keeps its behaviour, so greedy tokens say something. Simple
rounding (no search for the best scales, as llama-quantize does): exactness against
``gguf.quants.dequantize`` is what the tests check, not quantization quality.
"""

from __future__ import annotations

import numpy as np
import torch

QK = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """fp16 values ``[n]`` -> uint8 ``[n, 2]`` (little-endian)."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """fp32 ``[rows, cols]`` (cols a multiple of 256) -> Q4_K blocks uint8 ``[rows, cols / 256 * 144]``:
    w ~ d * sc * q - dmin * mn per 32 weights, q in 0..15, sc and mn 6-bit."""
    rows, cols = w.shape
    sub = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-block, weight]
    mn_f = np.maximum(0.0, -sub.min(axis=2))
    sc_f = (sub.max(axis=2) + mn_f) / 15.0
    d = (sc_f.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (mn_f.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(sc_f, d[:, None], out=np.zeros_like(sc_f), where=d[:, None] > 0)), 0, 63)
    mn = np.clip(
        np.rint(np.divide(mn_f, dmin[:, None], out=np.zeros_like(mn_f), where=dmin[:, None] > 0)), 0, 63
    )
    step = d[:, None] * sc
    q = np.divide(
        sub + (dmin[:, None] * mn)[..., None],
        step[..., None],
        out=np.zeros_like(sub),
        where=step[..., None] > 0,
    )
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)
    sc8, mn8 = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc8[:, 0:4] | ((sc8[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn8[:, 0:4] | ((mn8[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc8[:, 4:8] & 15) | ((mn8[:, 4:8] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low) and 2c + 1 (high)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(rows, cols // QK * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """fp32 ``[rows, cols]`` -> Q6_K blocks uint8 ``[rows, cols / 256 * 210]``: w ~ d * sc * (q - 32)
    per 16 weights, q in 0..63, sc int8."""
    rows, cols = w.shape
    sub = w.reshape(-1, 16, 16).astype(np.float32)
    sc_f = np.abs(sub).max(axis=2) / 31.0
    d = (sc_f.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(
        np.rint(np.divide(sc_f, d[:, None], out=np.zeros_like(sc_f), where=d[:, None] > 0)), -128, 127
    )
    step = (d[:, None] * sc)[..., None]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, c, i]
    lo = q & 15
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2
    )  # [b, h, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1
    )
    return out.reshape(rows, cols // QK * 210)


QUANTIZE = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` fp32 ``[rows, cols]`` as ``qtype`` (Q4_K or Q6_K) blocks."""
    return QUANTIZE[qtype](np.asarray(w, dtype=np.float32))


# Where each type's fp16 super-block scales sit (byte offsets) and a sane value for them.
_SCALES = {"Q4_K": ((0, 2), 0.0005), "Q6_K": ((208,), 0.0001)}
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def random_blocks(rows: int, cols: int, qtype: str, seed: int) -> np.ndarray:
    """Random bytes as ``qtype`` blocks ``[rows, cols / 256 * size]``, every byte random except the
    fp16 super-block scales (set to a sane value): any sub-scale, minimum and quant is valid."""
    size = BLOCK_BYTES[qtype]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // QK, size), dtype=np.uint8)
    offsets, value = _SCALES[qtype]
    for off in offsets:
        data[:, :, off : off + 2] = _f16_bytes(np.array([value]))[0]
    return data.reshape(rows, -1)


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """The gguf package's fp32 weights of ``raw`` blocks ``[rows, row_bytes]``, shaped ``[rows, cols]``."""
    import gguf

    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return np.asarray(w, dtype=np.float32).reshape(raw.shape[0], -1)


def round_inputs_as_the_kernel_does(x: torch.Tensor, block: int = QK, top: int = 127) -> torch.Tensor:
    """x (``[..., k]``) as a native integer kernel multiplies it, in x's dtype: each ``block``
    inputs (a last block of fewer: the inputs left) rounded to q * d with d = max|x| / ``top`` and
    q = x * (top / max|x|) rounded to nearest-even, in fp32 (an all-zero block stays zero). The
    K-quant kernel: 256 inputs to 8 bits (the defaults); int4 and int8: 32 to 16 bits
    (``INPUT_ROUNDING`` of kernels/cpu/quant_linear.py). Written from the documented rule
    (kernels/cpu/csrc/quant_linear.c), not from the kernel, for references and oracles."""
    k = x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, -k % block))  # a short last block: zeros round to 0
    xf = xf.reshape(*x.shape[:-1], -(-k // block), block)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: ``top / amax`` with a Python number on the left is not IEEE
    # division in torch (a quarter of such quotients are an ulp off), and at 16 bits an ulp of
    # the scale moves x * scale across a rounding boundary now and then.
    iscale = torch.where(amax > 0, torch.full_like(amax, float(top)) / amax, torch.zeros_like(amax))
    q = torch.round(xf * iscale)
    assert bool((q.abs() <= top).all())
    return (q * (amax / float(top))).reshape(*x.shape[:-1], xf.shape[-2] * block)[..., :k].to(x.dtype)
