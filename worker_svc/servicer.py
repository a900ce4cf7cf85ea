"""The Worker gRPC servicer: translate messages, call the model runner, map errors to statuses.

``run_step`` is the step itself, for both transports: gRPC ``Step`` and the one-host step channel
(worker_svc/step_channel.py) call it, so the cache checks, the step fence and the statuses
(``StepRefused``) are the same whichever way a step came.

Validation lives in ``ModelRunner.validate``; an ``InvalidStep`` becomes INVALID_ARGUMENT with its
message and nothing is run (cache ops included). Anything else unexpected is logged with its
traceback and returned as INTERNAL.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog
from google.rpc import error_details_pb2, status_pb2

from pagedkv import errors
from pagedkv.v1 import block_manager_pb2, worker_pb2, worker_pb2_grpc
from pagedkv.worker_svc.cache_watch import lost_message
from pagedkv.worker_svc.model.sampling import SamplingParams, TokenHistory
from pagedkv.worker_svc.model_runner import (
    CacheOpsRequest,
    InvalidStep,
    ModelRunner,
    RunnerClosed,
    SequenceRequest,
    SequenceResult,
)
from pagedkv.worker_svc.step_fence import StepFence

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
log = structlog.get_logger("pagedkv.worker")


def ops_from_proto(ops: block_manager_pb2.CacheOps) -> CacheOpsRequest:
    return CacheOpsRequest(
        swap_out=[(c.src, c.dst) for c in ops.swap_out],
        copies=[(c.src, c.dst) for c in ops.copies],
        swap_in=[(c.src, c.dst) for c in ops.swap_in],
    )


def sampling_from_proto(p: worker_pb2.SamplingParams) -> SamplingParams:
    if len(p.logit_bias_token_ids) != len(p.logit_bias_values):
        raise InvalidStep(
            f"sampling: {len(p.logit_bias_token_ids)} logit_bias_token_ids but "
            f"{len(p.logit_bias_values)} logit_bias_values"
        )
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        num_top_logprobs=p.num_top_logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
        min_p=p.min_p,
        logit_bias=tuple(zip(p.logit_bias_token_ids, p.logit_bias_values, strict=True)),
    )


class SamplingMemo:
    """The parsed ``SamplingParams`` of each distinct message, by its bytes.

    Why: a sequence sends the same sampling message with every step, and its field reads plus a
    frozen dataclass cost several times a serialisation and a lookup, paid for every sequence of
    every step (docs/benchmarks.md, "Measurements behind smaller choices"). ``SamplingParams`` is
    immutable, so one object serves every sequence and step that sends those bytes. Bounded: emptied
    past ``limit`` entries (a seed per request makes most messages distinct over a server's
    life)."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._parsed: dict[bytes, SamplingParams] = {}

    def get(self, p: worker_pb2.SamplingParams) -> SamplingParams:
        key = p.SerializeToString()
        got = self._parsed.get(key)
        if got is None:
            if len(self._parsed) >= self._limit:
                self._parsed.clear()
            got = self._parsed[key] = sampling_from_proto(p)
        return got


def sequence_from_proto(s: worker_pb2.SequenceInput, memo: SamplingMemo | None = None) -> SequenceRequest:
    # A slice copies a repeated field into a list at about twice list()'s speed (upb): this runs for
    # every sequence of every step.
    parse = sampling_from_proto if memo is None else memo.get
    forks = s.fork_sampling
    if len(s.output_token_ids) != len(s.output_token_counts):
        raise InvalidStep(
            f"sequence {s.seq_id!r}: {len(s.output_token_ids)} output_token_ids but "
            f"{len(s.output_token_counts)} output_token_counts"
        )
    return SequenceRequest(
        seq_id=s.seq_id,
        token_ids=s.token_ids[:],
        block_ids=s.block_ids[:],
        num_cached_tokens=s.num_cached_tokens,
        sampling=parse(s.sampling),
        return_logits=s.return_logits,
        fork_sampling=[parse(p) for p in forks] if forks else [],
        history=TokenHistory(s.output_token_ids[:], s.output_token_counts[:], s.prompt_token_ids[:])
        if s.output_token_ids or s.prompt_token_ids
        else None,
        allowed_token_mask=s.allowed_token_mask,
        decode_steps=s.decode_steps or 1,
        stop_token_ids=frozenset(s.stop_token_ids) if s.stop_token_ids else frozenset(),
        num_proposed=s.num_proposed_tokens,
        num_draft=s.num_draft_tokens,
        group_tables=[(t.first_block_index, t.block_ids[:]) for t in s.group_tables]
        if s.group_tables
        else [],
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        next_prompt_token=s.next_prompt_token_id if s.HasField("next_prompt_token_id") else None,
    )


def output_to_proto(resp: worker_pb2.WorkerStepResponse, o: SequenceResult) -> None:
    """Append ``o`` to ``resp.outputs``. Why ``add`` with only the fields that are set: a
    greedy step's outputs carry no logits, forks or top logprobs, and passing their empty lists to
    the constructor costs several times more, paid for every sequence of every step
    (docs/benchmarks.md, "Measurements behind smaller choices")."""
    msg = resp.outputs.add(seq_id=o.seq_id, token_id=o.token_id, logprob=o.logprob)
    if o.logits is not None:
        msg.logits.extend(o.logits.tolist())
    for d in o.fork_samples:
        msg.fork_samples.add(
            token_id=d.token_id,
            logprob=d.logprob,
            top_token_ids=[t for t, _ in d.top],
            top_logprobs=[lp for _, lp in d.top],
        )
    if o.top:
        msg.top_token_ids.extend(t for t, _ in o.top)
        msg.top_logprobs.extend(lp for _, lp in o.top)
    if o.num_accepted:
        msg.num_accepted_tokens = o.num_accepted
    if o.num_drafted:
        msg.num_draft_tokens = o.num_drafted
    for d in o.next_samples:
        nxt = msg.next_samples.add(token_id=d.token_id, logprob=d.logprob)
        if d.top:
            nxt.top_token_ids.extend(t for t, _ in d.top)
            nxt.top_logprobs.extend(lp for _, lp in d.top)
    for sc in o.prompt_logprobs:
        msg.prompt_logprobs.add(
            token_id=sc.token_id,
            logprob=sc.logprob,
            rank=sc.rank,
            top_token_ids=[t for t, _ in sc.top],
            top_logprobs=[lp for _, lp in sc.top],
        )


class StepRefused(Exception):
    """A step answered with a status instead of outputs: its gRPC code, message, and the
    ErrorInfo ``reason`` (+ metadata) when the engine must tell this cause from others."""

    def __init__(
        self, code: grpc.StatusCode, message: str, reason: str = "", metadata: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = metadata or {}

    def status(self) -> status_pb2.Status:
        """As the ``google.rpc.Status`` gRPC would carry (grpc-status-details-bin when ``reason``)."""
        out = status_pb2.Status(code=self.code.value[0], message=self.message)
        if self.reason:
            detail = out.details.add()
            detail.Pack(
                error_details_pb2.ErrorInfo(
                    reason=self.reason, domain=errors.WORKER_DOMAIN, metadata=self.metadata
                )
            )
        return out


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, info: worker_pb2.WorkerInfo) -> None:
        self._runner = runner
        self._info = info
        self._sampling = SamplingMemo()
        if not info.cache_state:
            info.cache_state = worker_pb2.CACHE_STATE_ATTACHED
        self._lost_message: str | None = None  # set once the cache host is lost (cache_watch.py)
        self.on_cache_lost: Callable[[], None] | None = None  # e.g. turn health NOT_SERVING
        self.fence = StepFence()  # steps running now, and the ones an engine gave up on (Fence)

    def mark_cache_lost(self, reason: str) -> bool:
        """Refuse every later step; True the first time (the caller logs it once)."""
        if self._lost_message is not None:
            return False
        info = worker_pb2.WorkerInfo()
        info.CopyFrom(self._info)
        info.cache_state = worker_pb2.CACHE_STATE_LOST
        info.cache_lost_reason = reason
        self._info = info
        self._lost_message = lost_message(reason)
        if self.on_cache_lost is not None:
            self.on_cache_lost()
        return True

    def resume_cache(self) -> None:
        """The cache host declared lost answered again as the SAME instance: its memory, and the
        KV in it, never went away, so steps are served again on the same mapping."""
        info = worker_pb2.WorkerInfo()
        info.CopyFrom(self._info)
        info.cache_state = worker_pb2.CACHE_STATE_ATTACHED
        info.cache_lost_reason = ""
        self._info = info
        self._lost_message = None

    @property
    def cache_lost(self) -> bool:
        return self._lost_message is not None

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    @property
    def info(self) -> worker_pb2.WorkerInfo:
        return self._info

    def attach(self, runner: ModelRunner, info: worker_pb2.WorkerInfo) -> None:
        """Serve steps again, on ``runner`` (a new cache host instance, worker_svc/reattach.py).

        The runner and the info (with the new ``cache_instance_id``) are in place before the lost
        state is cleared, so no step runs on the old cache once steps are accepted again."""
        self._runner = runner
        self._info = info
        self._lost_message = None

    def run_step(self, request: worker_pb2.WorkerStepRequest) -> worker_pb2.WorkerStepResponse:
        """One step, whichever transport brought it (gRPC ``Step`` or the one-host step channel,
        worker_svc/step_channel.py): the cache checks, the step fence and the error mapping are the
        same for both. Raises ``StepRefused`` with the status the caller must answer."""
        if self._lost_message is not None:
            raise StepRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                self._lost_message,
                errors.CACHE_HOST_LOST,
                {"cache_instance_id": self._info.cache_instance_id},
            )
        want = request.cache_instance_id
        if want and want != self._info.cache_instance_id:
            raise StepRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                lost_message(
                    f"the step expects cache host instance {want}, but this worker is attached to instance "
                    f"{self._info.cache_instance_id} (the cache host was replaced)"
                ),
                errors.CACHE_HOST_LOST,
                {"cache_instance_id": self._info.cache_instance_id},
            )
        rid = request.request_id
        if not self.fence.begin(rid):
            # The engine gave up on this step and ran it elsewhere (Fence): running it now could
            # write KV into blocks that other sequences hold by now.
            raise StepRefused(
                grpc.StatusCode.ABORTED,
                f"step {rid!r} was fenced: the engine stopped waiting for it and ran it on another worker",
            )
        seqs: list[SequenceRequest] = []
        try:
            seqs = [sequence_from_proto(s, self._sampling) for s in request.sequences]
            ops = ops_from_proto(request.ops)
            result = self._runner.step(seqs, ops)
        except InvalidStep as e:
            raise StepRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        except RunnerClosed as e:
            raise StepRefused(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        except Exception as e:  # noqa: BLE001 - turn into a status, keep the trace in the log
            log.exception("step_failed", request_id=request.request_id, num_seqs=len(seqs))
            raise StepRefused(grpc.StatusCode.INTERNAL, f"step failed: {type(e).__name__}: {e}") from e
        finally:
            self.fence.end(rid)
        log.debug(
            "step",
            request_id=request.request_id,
            num_seqs=len(seqs),
            num_tokens=result.num_tokens,
            cache_ops_ms=round(result.cache_ops_ms, 3),
            forward_ms=round(result.forward_ms, 3),
        )
        resp = worker_pb2.WorkerStepResponse(
            num_tokens=result.num_tokens,
            cache_ops_ms=result.cache_ops_ms,
            forward_ms=result.forward_ms,
        )
        for o in result.outputs:
            output_to_proto(resp, o)
        return resp

    def Step(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.WorkerStepRequest, context: grpc.ServicerContext
    ) -> worker_pb2.WorkerStepResponse:
        try:
            return self.run_step(request)
        except StepRefused as e:
            if e.reason:
                errors.abort(context, e.code, e.message, e.reason, **e.metadata)
            context.abort(e.code, e.message)
            raise AssertionError("unreachable") from e  # abort raises

    def GetWorkerInfo(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self._info

    def Fence(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.FenceRequest, context: grpc.ServicerContext
    ) -> worker_pb2.FenceReply:
        running = self.fence.fence(request.request_ids)
        if running:
            log.warning("fenced_steps_running", request_ids=running)
        return worker_pb2.FenceReply(running_request_ids=running)
