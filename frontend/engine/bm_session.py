"""The engine's one conversation with the block manager: the only module of the engine that calls it.

- **Request ids.** Every mutation (Step, KeepAlive, ResetPrefixCache) carries one
  (``<lease>-<kind>-<n>``), so any of them may be retried: a Step the manager applied but whose reply
  was lost is answered from its dedupe table, never applied twice.
- **Outage budget.** UNAVAILABLE and DEADLINE_EXCEEDED are retried with capped exponential backoff
  (full jitter, at most 1 s) until ``EngineConfig.block_manager_outage_s`` has passed since the first
  failed call; then BlockManagerUnavailable. Each call's deadline is
  ``EngineConfig.block_manager_timeout_s`` (5 s): a hung manager or a silent link costs at most that
  before the same request is sent again.
- **The lease.** A background thread renews it every third of its TTL. A KeepAlive that *created*
  it (from that thread, or the renewal before each retry) means the manager lost this engine's
  sequences (restarted without a state dir, or the lease expired): ``lease_lost`` is set, and a
  Step that needs the engine's state raises ManagerLostState instead of being sent.
- **Typed deltas.** :meth:`BlockManagerSession.step` sends the engine's ``StepPlan`` as the packed
  StepRequest and answers with a ``StepDelta`` (frontend/engine/step_messages.py translates both).
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.engine.step_messages import (
    StepDelta,
    StepPlan,
    step_delta,
    step_request,
    unknown_sequences,
)
from pagedkv.frontend.engine.types import BlockManagerUnavailable, EngineConfig, EngineStats, ManagerLostState
from pagedkv.v1 import block_manager_pb2 as pb

log = structlog.get_logger("pagedkv.engine")

T = TypeVar("T")
# A block manager that is restarting (UNAVAILABLE) or hung (DEADLINE_EXCEEDED): retried within the
# outage budget.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_MAX_BACKOFF_S = 1.0


@dataclass(slots=True, frozen=True)
class PoolGeometry:
    """The block manager's pool, as the engine plans with it."""

    block_size: int
    num_gpu_blocks: int
    watermark_blocks: int
    prefix_caching: bool
    # Config.kv_groups as each group's window in tokens (0: full attention); one full group when
    # the manager names none.
    kv_groups: tuple[int, ...] = (0,)


def read_geometry(bm: BlockManagerClient, timeout_s: float) -> PoolGeometry:
    """GetConfig (a read, retried by the client on UNAVAILABLE)."""
    c = bm.get_config(timeout_s=timeout_s)
    groups = tuple(g.window_tokens if g.kind == "window" else 0 for g in c.kv_groups) or (0,)
    return PoolGeometry(c.block_size, c.num_gpu_blocks, c.watermark_blocks, c.enable_prefix_caching, groups)


def _renew_lease(ref: weakref.ref[BlockManagerSession], stop: threading.Event, interval_s: float) -> None:
    """Renew the lease until the session is closed or garbage-collected (holds no strong ref)."""
    while not stop.wait(interval_s):
        session = ref()
        if session is None:
            return
        try:
            session.keep_alive(timeout_s=min(session.config.timeout_s, interval_s))
        except grpc.RpcError as e:
            log.warning("lease_renewal_failed", lease_id=session.lease_id, code=e.code().name)
        except ValueError:  # the client's channel was closed under a live engine: nothing to renew on
            return
        del session


class BlockManagerSession:
    """One engine's session: its lease, its request ids, the outage budget."""

    def __init__(
        self, bm: BlockManagerClient, lease_id: str, config: EngineConfig, stats: EngineStats
    ) -> None:
        self.bm = bm
        self.lease_id = lease_id
        self.config = config
        self.stats = stats
        self._ids = itertools.count()
        # Set when a KeepAlive created this engine's lease anew: the manager lost its sequences.
        self.lease_lost = threading.Event()
        self.keep_alive(timeout_s=config.timeout_s, first=True)
        self._stop_renewal = threading.Event()
        self._renewer = threading.Thread(
            target=_renew_lease,
            args=(weakref.ref(self), self._stop_renewal, config.lease_ttl_s / 3),
            name=f"engine-lease-{lease_id}",
            daemon=True,
        )
        self._renewer.start()
        weakref.finalize(self, self._stop_renewal.set)

    def stop_renewal(self) -> None:
        self._stop_renewal.set()

    def request_id(self, kind: str) -> str:
        return f"{self.lease_id}-{kind}-{next(self._ids)}"

    def keep_alive(self, timeout_s: float, first: bool = False) -> None:
        """Renew the lease. One that *created* it means the manager forgot it, and with it this
        engine's sequences: ``lease_lost`` is set and the next step resyncs (``first``: expected)."""
        resp = self.bm.keep_alive(
            self.lease_id,
            ttl_ms=round(self.config.lease_ttl_s * 1000),
            request_id=self.request_id("lease"),
            timeout_s=timeout_s,
        )
        self.stats.lease_renewals += 1
        if resp.created and not first:
            # (A renewal racing a resync may set this once more: one more resync, still correct.)
            self.lease_lost.set()
            log.warning("block_manager_lost_lease", lease_id=self.lease_id, action="resync")

    def reachable(self, timeout_s: float = 2.0) -> bool:
        """One lease renewal: does the block manager answer now? (After BlockManagerUnavailable.)"""
        try:
            self.keep_alive(timeout_s=timeout_s)
        except grpc.RpcError:
            return False
        return True

    def call(self, fn: Callable[[float], T], *, needs_state: bool = True) -> T:
        """Run one block-manager call, ``fn(timeout_s)``, riding out an outage: UNAVAILABLE and
        DEADLINE_EXCEEDED are retried with capped exponential backoff (full jitter) until
        ``block_manager_outage_s`` has passed since the first failure, then BlockManagerUnavailable.
        Safe because every mutation carries a request id. Before each retry the lease is renewed:
        a manager that came back without this engine's state (``needs_state``) raises
        ManagerLostState instead of being sent a Step about sequences it never heard of."""
        budget = self.config.block_manager_outage_s
        outage_start: float | None = None
        attempt = 0
        while True:
            now = time.monotonic()
            left = budget if outage_start is None else budget - (now - outage_start)
            timeout_s = max(min(self.config.block_manager_timeout_s, left), 0.5)
            began = now
            try:
                if outage_start is not None:
                    self.keep_alive(timeout_s=timeout_s)
                if needs_state and self.lease_lost.is_set():
                    raise ManagerLostState("the block manager lost this engine's lease and sequences")
                result = fn(timeout_s)
            except ManagerLostState:
                if outage_start is not None:
                    self._note_stall(outage_start, attempt)
                raise
            except grpc.RpcError as e:
                if e.code() not in _TRANSIENT:
                    raise
                now = time.monotonic()
                if outage_start is None:
                    outage_start = began  # a hung manager's first unanswered call counts
                    log.warning("block_manager_unreachable", code=e.code().name, budget_s=budget)
                waited = now - outage_start
                if waited >= budget:
                    self.stats.longest_stall_s = max(self.stats.longest_stall_s, waited)
                    raise BlockManagerUnavailable(
                        f"the block manager was unreachable for {waited:.1f} s "
                        f"(block_manager_outage_s={budget:g}): "
                        f"{e.code().name} {e.details()}"
                    ) from e
                attempt += 1
                self.stats.bm_retries += 1
                cap = min(0.05 * 2 ** (attempt - 1), _MAX_BACKOFF_S)
                time.sleep(min(random.uniform(cap / 2, cap), max(budget - waited, 0.0)))
                continue
            if outage_start is not None:
                self._note_stall(outage_start, attempt)
            return result

    def _note_stall(self, outage_start: float, retries: int) -> None:
        stall = time.monotonic() - outage_start
        self.stats.longest_stall_s = max(self.stats.longest_stall_s, stall)
        log.warning("block_manager_reachable", stall_s=round(stall, 3), retries=retries)

    def step(self, plan: StepPlan, *, needs_state: bool = True) -> StepDelta:
        """One Step with a request id (so it may be retried), through the outage budget. Raises
        ManagerLostState when the reply shows the manager does not know the engine's sequences."""
        req = step_request(plan, self.lease_id)
        req.request_id = self.request_id("step")
        resp = self.call(lambda t: self.bm.step(req, timeout_s=t), needs_state=needs_state)
        self.stats.bm_round_trips += 1
        delta = step_delta(resp, len(plan.allocs))
        if needs_state:
            lost = unknown_sequences(delta, plan)
            if lost:
                raise ManagerLostState(
                    f"the block manager does not know {len(lost)} of this engine's sequences "
                    f"(e.g. {lost[0]}): it restarted without its state, or the lease expired"
                )
        return delta

    def free(self, seq_ids: Sequence[str]) -> StepDelta:
        """Free sequences the manager may or may not still hold (unknown ones are just reported)."""
        return self.step(StepPlan(frees=list(seq_ids)), needs_state=False)

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache hash (the KV they named is gone with the cache host)."""
        rid = self.request_id("reset")
        self.call(lambda t: self.bm.reset_prefix_cache(request_id=rid, timeout_s=t), needs_state=False)

    def free_now(self, seq_ids: Sequence[str]) -> None:
        """One attempt, no outage budget (closing the engine: the lease frees the rest)."""
        if seq_ids:
            self.bm.step(
                pb.StepRequest(free_seq_ids=list(seq_ids), request_id=self.request_id("close")),
                timeout_s=self.config.timeout_s,
            )
