"""Deciding the cache geometry at start-up, from up to four sources that must agree.

Sources: the model (layers, KV heads, head size), this process's settings (flags / ``PAGEDKV_*``),
the block manager (``GetConfig``: block size, GPU and CPU block counts, KV dtype, and the bytes per
block when it sized its pool from a memory budget) and, for a worker, the cache host
(``GetCacheInfo``). A value given explicitly in the settings must equal the block
manager's; the cache host's must equal whatever the worker knows. Any disagreement refuses the
start with ``GeometryMismatch`` naming the value and where each side got it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup, format_kv_groups, parse_kv_groups
from pagedkv.dial import PLAIN, Dialer
from pagedkv.plan import ModelSize
from pagedkv.v1 import block_manager_pb2, block_manager_pb2_grpc
from pagedkv.worker_svc.cache.layout import CacheGeometry, GeometryMismatch
from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.model.kv_layout import kv_layout
from pagedkv.worker_svc.settings import _Common

POOL_FIELDS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_dtype")


@dataclass(slots=True, frozen=True)
class PoolConfig:
    """The block manager's part of the geometry."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    kv_cache_dtype: str = "auto"
    # What it divided its memory budget by, and the budget (0: the pool is counted in blocks and
    # kv_bytes_per_block is only its cost model's estimate, so nothing is checked against it).
    kv_bytes_per_block: int = 0
    kv_cache_memory_bytes: int = 0
    # The pool's KV-cache groups (--kv-groups): one full group, or the model's (kv_layout.py), and
    # then one block holds one group's layers.
    kv_groups: tuple[KVGroup, ...] = ONE_GROUP


@dataclass(slots=True, frozen=True)
class Sourced:
    """A value and where it came from, for error messages."""

    value: int | str
    source: str


def fetch_pool_config(target: str, timeout_s: float = 10.0, dialer: Dialer = PLAIN) -> PoolConfig:
    """Ask the block manager for its geometry (one attempt; worker_svc/peers.py retries)."""
    with dialer.channel(target) as channel:
        stub = block_manager_pb2_grpc.BlockManagerStub(channel)
        cfg = stub.GetConfig(
            block_manager_pb2.GetConfigRequest(), timeout=timeout_s, metadata=dialer.metadata
        )
    return PoolConfig(
        block_size=cfg.block_size,
        num_gpu_blocks=cfg.num_gpu_blocks,
        num_cpu_blocks=cfg.num_cpu_blocks,
        kv_cache_dtype=cfg.kv_cache_dtype or "auto",  # an older manager sends none
        kv_bytes_per_block=cfg.kv_bytes_per_block,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        kv_groups=tuple(KVGroup(g.kind, g.window_tokens) for g in cfg.kv_groups) or ONE_GROUP,
    )


def layers_per_block(model: ModelConfig, pool: PoolConfig | None) -> int:
    """The layers one block holds: all of them, or one group's with the pool's groups (a pool
    whose groups do not fit the model raises GeometryMismatch)."""
    try:
        return kv_layout(model, pool.kv_groups if pool is not None else ONE_GROUP).layers_per_block
    except ValueError as e:
        raise GeometryMismatch(f"cache geometry mismatch: kv_groups: {e}") from None


def draft_config(draft: str | None, model: ModelConfig) -> ModelConfig | None:
    """The draft model's config (``--speculative-model``; None: none), refused unless it shares the
    target's vocabulary: verification compares the draft's token ids with the target's own."""
    if not draft:
        return None
    from pagedkv.worker_svc.model.config import load_model_config

    try:
        cfg = load_model_config(draft)
    except FileNotFoundError as e:  # the reader names --model: this is the draft
        raise FileNotFoundError(str(e).replace("--model ", "--speculative-model ", 1)) from None
    except ValueError as e:
        raise ValueError(f"--speculative-model {draft}: {e}") from None
    if cfg.vocab_size != model.vocab_size:
        raise GeometryMismatch(
            f"the draft model {cfg.name} ({draft}) has a vocabulary of {cfg.vocab_size} tokens, the model "
            f"{model.name} {model.vocab_size}: a draft must share the model's vocabulary"
        )
    return cfg


def draft_geometry(draft: ModelConfig | None) -> dict[str, int]:
    """CacheGeometry's draft fields for ``draft`` (every layer in its block: one full group)."""
    if draft is None:
        return {}
    return {
        "draft_num_layers": draft.num_layers,
        "draft_num_kv_heads": draft.num_kv_heads,
        "draft_head_dim": draft.head_dim,
    }


def known_values(settings: _Common, model: ModelConfig, pool: PoolConfig | None) -> dict[str, Sourced]:
    """Every geometry value this process knows, checked against each other.

    Pool values: the block manager's when it was asked (an explicit, different setting is an
    error), else explicit settings, else nothing (a worker then takes the cache host's value; the
    cache host falls back to its defaults in ``host_geometry``).
    """
    known: dict[str, Sourced] = {
        "num_layers": Sourced(layers_per_block(model, pool), f"model {model.name}"),
        "num_kv_heads": Sourced(model.num_kv_heads, f"model {model.name}"),
        "head_dim": Sourced(model.head_dim, f"model {model.name}"),
    }
    draft = draft_config(settings.speculative_model, model)
    where = (
        f"draft model {draft.name} (--speculative-model)" if draft else "settings (no --speculative-model)"
    )
    drafted = draft_geometry(draft)
    for name in ("draft_num_layers", "draft_num_kv_heads", "draft_head_dim"):
        known[name] = Sourced(drafted.get(name, 0), where)
    explicit = settings.model_fields_set
    if settings.num_layers is not None and settings.num_layers != model.num_layers:
        raise GeometryMismatch(
            f"cache geometry mismatch: num_layers: settings (--num-layers) have {settings.num_layers}, "
            f"model {model.name} has {model.num_layers}"
        )
    for name in POOL_FIELDS:
        mine = getattr(settings, name)
        if pool is not None:
            theirs = getattr(pool, name)
            if name in explicit and mine != theirs:
                raise GeometryMismatch(
                    f"cache geometry mismatch: {name}: settings (--{name.replace('_', '-')} / "
                    f"PAGEDKV_{name.upper()}) have {mine}, the block manager has {theirs}"
                )
            known[name] = Sourced(theirs, "the block manager")
        elif name in explicit:
            known[name] = Sourced(mine, "settings")
    return known


def host_geometry(settings: _Common, model: ModelConfig, pool: PoolConfig | None) -> CacheGeometry:
    """The cache host's geometry: known values, defaults for the rest."""
    known = known_values(settings, model, pool)
    values = {name: (known[name].value if name in known else getattr(settings, name)) for name in POOL_FIELDS}
    return CacheGeometry(
        num_layers=layers_per_block(model, pool),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=int(values["block_size"]),
        num_gpu_blocks=int(values["num_gpu_blocks"]),
        num_cpu_blocks=int(values["num_cpu_blocks"]),
        kv_cache_dtype=str(values["kv_cache_dtype"]),
        draft_num_layers=int(known["draft_num_layers"].value),
        draft_num_kv_heads=int(known["draft_num_kv_heads"].value),
        draft_head_dim=int(known["draft_head_dim"].value),
    )


def check_block_bytes(pool: PoolConfig | None, geometry: CacheGeometry, dtype: torch.dtype, who: str) -> None:
    """When the block manager sized its pool from a memory budget, the bytes per block it divided by
    must be this cache's (model dims x KV dtype, scales included), or the pool would not be the
    memory the budget says."""
    if pool is None or not pool.kv_cache_memory_bytes:
        return
    mine = geometry.block_bytes(dtype)
    if mine != pool.kv_bytes_per_block:
        raise GeometryMismatch(
            f"cache geometry mismatch: kv_bytes_per_block: the block manager has {pool.kv_bytes_per_block} "
            f"(--kv-bytes-per-block), {who} has {mine} ({geometry.num_layers} layers x 2 x "
            f"{geometry.block_size} tokens x {geometry.num_kv_heads} KV heads x head_dim "
            f"{geometry.head_dim}, "
            f"kv_cache_dtype {geometry.kv_cache_dtype}, model dtype {str(dtype).removeprefix('torch.')})"
        )


def check_against_host(known: dict[str, Sourced], host: CacheGeometry, host_name: str) -> None:
    """A worker's check: every value it knows must equal the cache host's."""
    diffs = [
        f"{name}: {s.source} has {s.value}, {host_name} has {getattr(host, name)}"
        for name, s in known.items()
        if getattr(host, name) != s.value
    ]
    if diffs:
        raise GeometryMismatch("cache geometry mismatch: " + "; ".join(diffs))


def kv_groups_for(model: str | None, choice: str = "auto") -> str:
    """The block manager's ``--kv-groups`` for ``model``: ``auto`` its own layer groups
    (kv_layout.py: Gemma 3 270M ``full,window:512x5``), ``full`` (or empty) one table for every
    layer (the flat layout: ""), else ``choice`` itself, checked against the model."""
    from pagedkv.worker_svc.model.config import load_model_config
    from pagedkv.worker_svc.model.kv_layout import model_kv_groups

    cfg = load_model_config(model)
    if choice == "auto":
        groups = model_kv_groups(cfg)
    else:
        groups = kv_layout(cfg, parse_kv_groups("" if choice == "full" else choice)).groups
    return "" if groups == ONE_GROUP else format_kv_groups(groups)


def model_block_bytes(
    model: str | None,
    dtype: str,
    device: str,
    block_size: int,
    kv_cache_dtype: str,
    kv_groups: str = "",
    draft: str | None = None,
) -> int:
    """Bytes of one cache block for this model, dtype setting, device and KV dtype: what a launcher
    (``pagedkv up``, the in-process stack) gives the block manager with a ``--kv-cache-memory`` budget,
    computed exactly as the cache host will check it. ``kv_groups``: the block manager's
    ``--kv-groups`` (empty: one group; a block then holds every layer); ``draft``: the
    ``--speculative-model``, whose layers each block holds too."""
    return model_size(
        model, dtype, device, block_size, kv_cache_dtype, "auto", kv_groups, draft
    ).kv_bytes_per_block


# Bytes a weight takes per parameter in each held format (int8 / int4 with their per-group scales).
_FORMAT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0625, "int4": 0.5625}


def model_size(
    model: str | None,
    dtype: str,
    device: str,
    block_size: int,
    kv_cache_dtype: str,
    weight_format: str,
    kv_groups: str = "",
    draft: str | None = None,
) -> ModelSize:
    """What ``pagedkv up``'s plan (``pagedkv/plan.py``) needs of the model: the weights' bytes as the
    stack will hold them, one KV block's bytes (exactly as the cache host checks them) and the model's
    longest sequence. The weights are estimated from the config's matrices, except a GGUF file held
    in its own quantization (``auto`` on a CPU), which is the file's size. ``draft``: the
    ``--speculative-model``, whose KV each block holds too and whose weights each worker loads."""
    import pathlib

    from pagedkv.worker_svc.devices import resolve_device, resolve_dtype
    from pagedkv.worker_svc.model.config import load_model_config

    cfg = load_model_config(model)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    slots = kv_layout(cfg, parse_kv_groups(kv_groups)).layers_per_block
    draft_cfg = draft_config(draft, cfg)
    geometry = CacheGeometry(
        slots, cfg.num_kv_heads, cfg.head_dim, block_size, 1, 0, kv_cache_dtype, **draft_geometry(draft_cfg)
    )

    def weights_of(path: str | None, c: ModelConfig) -> int:
        if path and pathlib.Path(path).is_file() and weight_format == "auto" and dev.type == "cpu":
            return pathlib.Path(path).stat().st_size
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = h * q * 2 + h * kv * 2 + 3 * h * c.intermediate_size
        embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        per_param = _FORMAT_BYTES.get(weight_format, float(torch_dtype.itemsize))
        return int((c.num_layers * per_layer + embeddings) * per_param)

    draft_bytes = weights_of(draft, draft_cfg) if draft_cfg is not None else 0
    return ModelSize(
        weight_bytes=weights_of(model, cfg),
        kv_bytes_per_block=geometry.block_bytes(torch_dtype),
        block_size=block_size,
        max_model_len=cfg.max_position_embeddings,
        kv_groups=kv_groups,
        layers_per_block=slots,
        num_layers=cfg.num_layers,
        draft_weight_bytes=draft_bytes,
    )
