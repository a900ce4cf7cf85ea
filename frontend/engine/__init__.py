"""The continuous-batching engine (frontend/engine/core.py), split by job: scheduler.py (the
iteration's plan, pure), bm_session.py (the block-manager conversation), output.py (tokens, stop
checks), recovery.py (lost cache host, block manager restarted without the engine's state),
types.py (the values), dispatch.py (which workers run a step), admission.py (which waiting
requests start). What other code imports comes from here."""

from frontend.engine.core import Engine
from frontend.engine.types import (
    MAX_TOP_LOGPROBS,
    BlockManagerUnavailable,
    CacheHostLost,
    Completion,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    ManagerLostState,
    RequestOutput,
    SamplingOptions,
    Seq,
    SeqStatus,
    TokenEvent,
)

__all__ = [
    "MAX_TOP_LOGPROBS",
    "BlockManagerUnavailable",
    "CacheHostLost",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationRequest",
    "ManagerLostState",
    "RequestOutput",
    "SamplingOptions",
    "Seq",
    "SeqStatus",
    "TokenEvent",
]
