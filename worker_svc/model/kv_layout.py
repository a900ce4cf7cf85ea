"""Which cache slot and which block table each layer of a model uses (KV-cache groups).

A model declares its layer groups (block_manager_svc/core/kv_groups.py): its layers split by
attention type into groups of one size, each full attention or a sliding window of W tokens.
Gemma 3 270M's 18 layers (3 global, 15 with W = 512) are 6 groups of 3: group 0 the global
layers, groups 1..5 five runs of three window layers. One physical block then holds the KV of
one group's layers (``layers_per_block``, the cache's first dimension), and layer l of group g
reads and writes cache slot ``layer_slot[l]`` through group g's block table: a window group's
table keeps only its window's blocks, so the pool holds about 1/6 of the flat cache per token at
8k tokens.

The block manager's ``--kv-groups`` is the pool's choice: the model's groups, or one full group
(every layer in every block, one table: the flat layout, with the windows still applied by the
kernels). Anything else does not fit the model and is refused at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup, format_kv_groups
from pagedkv.worker_svc.model.config import ModelConfig


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Each layer's group (its block table) and slot (its place among its block's layers)."""

    groups: tuple[KVGroup, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def layers_per_block(self) -> int:
        return len(self.layer_group) // len(self.groups)

    @property
    def grouped(self) -> bool:
        return len(self.groups) > 1


def _by_kind(cfg: ModelConfig) -> dict[int | None, list[int]]:
    """Layers by window (None: full attention), kinds in the order of their first layer."""
    windows = cfg.layer_windows or (None,) * cfg.num_layers
    out: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        out.setdefault(w, []).append(i)
    return out


def model_kv_groups(cfg: ModelConfig) -> tuple[KVGroup, ...]:
    """The model's layer groups: one full group unless it has both full-attention and window
    layers; then groups of gcd(layer counts per kind) layers, the full ones first."""
    kinds = _by_kind(cfg)
    if None not in kinds or len(kinds) == 1:
        return ONE_GROUP
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = [KVGroup.full()] * (len(kinds[None]) // size)
    for w, layers in kinds.items():
        if w is not None:
            groups += [KVGroup.window(w)] * (len(layers) // size)
    return tuple(groups)


def kv_layout(cfg: ModelConfig, groups: tuple[KVGroup, ...] = ONE_GROUP) -> KVLayout:
    """The layout of ``cfg`` under the pool's ``groups``: one full group (the flat layout) or
    the model's own groups; any other raises ``ValueError`` naming both."""
    n = cfg.num_layers
    if tuple(groups) == ONE_GROUP:
        return KVLayout(ONE_GROUP, (0,) * n, tuple(range(n)))
    mine = model_kv_groups(cfg)
    if tuple(groups) != mine:
        raise ValueError(
            f"the block manager's kv_groups {format_kv_groups(tuple(groups))!r} do not fit model "
            f"{cfg.name}, whose layers are {format_kv_groups(mine)!r} (or one full group: 'full')"
        )
    size = n // len(mine)
    layer_group, layer_slot = [0] * n, [0] * n
    first = 0  # the first group of the kind being placed
    for _, layers in sorted(_by_kind(cfg).items(), key=lambda kv: kv[0] is not None):
        for j, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = first + j // size, j % size
        first += len(layers) // size
    return KVLayout(mine, tuple(layer_group), tuple(layer_slot))
