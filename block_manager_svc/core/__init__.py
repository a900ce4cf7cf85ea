"""The pure allocator core: no gRPC, no logging, no clock.

Everything that decides lives here, one decision per module, so it can be
tested exhaustively and reused in-process: who gets which block (manager.py,
block_pool.py), what the prefix cache matches (prefix_cache.py), what to evict
(eviction.py), whom to preempt and how, and swap-in (preemption.py with the
cost model in swap_planner.py), what a tenant is charged (tenants.py), and
what must always hold (invariants.py). The servicer only validates transport
concerns and translates.
"""

from pagedkv.block_manager_svc.core.errors import (
    AlreadyExists,
    CoreError,
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from pagedkv.block_manager_svc.core.manager import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.results import (
    AllocateResult,
    AppendResult,
    BlockTable,
    CacheOps,
    ItemError,
    Stats,
    StepResult,
)
from pagedkv.block_manager_svc.core.step_batch import StepBatch

__all__ = [
    "AllocateResult",
    "AlreadyExists",
    "AppendResult",
    "BlockManager",
    "BlockTable",
    "CacheOps",
    "CoreConfig",
    "CoreError",
    "ErrorCode",
    "FailedPrecondition",
    "InvalidArgument",
    "ItemError",
    "NotFound",
    "ResourceExhausted",
    "Stats",
    "StepBatch",
    "StepResult",
]
