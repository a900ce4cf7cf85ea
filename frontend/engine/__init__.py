"""The continuous-batching engine (frontend/engine/engine.py: plan, call, apply), split by job:
scheduler.py (the queues and every transition), remote_table.py (what the block manager holds for
each sequence and what it is owed, reconciled with each Step), policy.py (who goes this iteration, pure),
bm_session.py (the block-manager conversation), step_messages.py (the Step's values and wire form),
output.py (the worker's messages, tokens, stop checks), recovery.py (lost cache host, block manager
restarted without the engine's state), types.py (the values), dispatch.py (which workers run a step),
admission.py (which waiting requests start), beam.py (beam search's decisions, pure) and
beam_group.py (a beam-search request's sequences). What other code imports comes from here."""

from pagedkv.frontend.engine.beam import BeamParams
from pagedkv.frontend.engine.engine import Engine
from pagedkv.frontend.engine.types import (
    MAX_TOP_LOGPROBS,
    BlockManagerUnavailable,
    CacheHostLost,
    Completion,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    ManagerLostState,
    PromptLogprob,
    RequestOutput,
    SamplingOptions,
    Seq,
    SeqStatus,
    TokenEvent,
)

__all__ = [
    "MAX_TOP_LOGPROBS",
    "BeamParams",
    "BlockManagerUnavailable",
    "CacheHostLost",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationRequest",
    "ManagerLostState",
    "PromptLogprob",
    "RequestOutput",
    "SamplingOptions",
    "Seq",
    "SeqStatus",
    "TokenEvent",
]
