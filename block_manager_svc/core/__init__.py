"""The pure allocator core: no gRPC, no logging, no clock.

Everything that decides (who gets which block, what the prefix cache holds,
what to evict) lives here so it can be tested exhaustively and reused
in-process; the servicer only validates transport concerns and translates.
"""

from block_manager_svc.core.errors import (
    AlreadyExists,
    CoreError,
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from block_manager_svc.core.manager import BlockManager, CoreConfig
from block_manager_svc.core.results import (
    AllocateResult,
    AppendResult,
    BlockTable,
    CacheOps,
    ItemError,
    Stats,
    StepResult,
)

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
    "StepResult",
]
