"""What the engine does when a service around it loses state (docs/reliability.md):

- **cache host lost** (every worker says so): without ``recover_lost_cache``, forget the dead KV
  (free the sequences, reset the prefix cache) and raise CacheHostLost with what to do; with it,
  wait for a worker attached to a cache host again, free every sequence and recompute every running
  and swapped sequence. A NEW instance has empty memory: the prefix cache is reset first. The SAME
  instance answering again (it only hung: a pause, a silent link) still holds the KV: the prefix
  cache is kept, so the recompute re-allocates what was committed as prefix hits and computes only
  the rest (the failed step's cache ops and the prefill in flight are redone that way);
- **block manager lost the engine's sequences** (restarted without a state dir, or the lease
  expired; frontend/engine/bm_session.py detects it): free whatever it may still hold of them,
  renew the lease, recompute every running and swapped sequence (re-allocated in the next Step,
  with prefix hits where the manager still has committed blocks).

A lost worker is frontend/engine/dispatch.py's: its share moves to another worker on the same cache.
Recomputing is the recompute-preemption path: prompt + tokens so far, so greedy outputs are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc
import structlog

from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine.bm_session import BlockManagerSession
from pagedkv.frontend.engine.dispatch import CacheLostEverywhere
from pagedkv.frontend.engine.scheduler import Scheduler
from pagedkv.frontend.engine.types import (
    BlockManagerUnavailable,
    CacheHostLost,
    EngineConfig,
    ManagerLostState,
)
from pagedkv.v1 import worker_pb2 as wpb

log = structlog.get_logger("pagedkv.engine")


def cache_host_lost(e: CacheLostEverywhere) -> CacheHostLost:
    """Every worker tried says the cache host is gone (dispatch.py)."""
    return CacheHostLost(
        f"the cache host was lost, and with it the KV of every sequence ({'; '.join(e.details)}). "
        "Restart the cache host and the workers (a worker exits with code 3 after a lost cache host "
        "and re-attaches when restarted), then resubmit the requests, or run the engine with "
        "EngineConfig(recover_lost_cache=True) to wait for a re-attached worker, reset the block "
        "manager's prefix cache and re-prefill every running sequence"
    )


def forget_lost_cache(close: Callable[[], None], session: BlockManagerSession) -> None:
    """Before CacheHostLost reaches the caller: the committed blocks name KV that died, so drop
    them from the shared prefix cache (or a later frontend would hit garbage), and free this
    engine's sequences (``close``, the engine's). Best effort: the caller gets CacheHostLost either way."""
    try:
        close()
        session.reset_prefix_cache()
    except (grpc.RpcError, BlockManagerUnavailable) as e:
        log.warning("prefix_cache_reset_failed", error=str(e))


def attached_instance(workers: Sequence[WorkerClient], old: str, timeout_s: float) -> str:
    """The cache instance a worker is attached to again: a new one, or ``old`` itself when the
    worker found the same instance answering again (worker_svc/cache_watch.py ``on_resumed``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for w in workers:
            try:
                info = w.get_info(timeout_s=2.0)
            except grpc.RpcError:
                continue
            if info.cache_instance_id and info.cache_state != wpb.CACHE_STATE_LOST:
                return info.cache_instance_id
        if time.monotonic() > deadline:
            raise CacheHostLost(
                f"the cache host (instance {old}) was lost and no worker re-attached to it or to a new "
                f"one within {timeout_s:.0f} s (cache_recovery_timeout_s): restart "
                "the cache host and the workers"
            )
        time.sleep(0.2)


def recover_lost_cache(
    scheduler: Scheduler,
    session: BlockManagerSession,
    workers: Sequence[WorkerClient],
    old: str,
    config: EngineConfig,
) -> str:
    """After CacheHostLost (the prefill in flight already dropped): wait for a worker attached
    again, forget all cached KV if it is a new instance (the block manager's prefix cache), and
    recompute every running and swapped sequence from its prompt + generated tokens. Returns the
    cache instance attached now."""
    log.warning(
        "cache_host_lost",
        cache_instance_id=old,
        action="waiting for a re-attached worker",
        timeout_s=config.cache_recovery_timeout_s,
    )
    new = attached_instance(workers, old, config.cache_recovery_timeout_s)
    resumed = new == old  # it only hung: its memory, and the committed KV, are intact
    # Finished ones too: what they computed died with the cache host and must never be committed.
    victims, frees = scheduler.take_block_holders()
    if frees:
        session.free(frees)  # a sequence the block manager no longer has is simply reported
    if not resumed:
        session.reset_prefix_cache()
    scheduler.requeue_all(victims)
    scheduler.stats.cache_recoveries += 1
    log.warning(
        "cache_host_resumed" if resumed else "cache_recovered",
        old_cache_instance_id=old,
        cache_instance_id=new,
        requeued=len(victims),
        action="re-establishing with prefix hits" if resumed else "re-prefilling",
    )
    return new


def resync(scheduler: Scheduler, session: BlockManagerSession, lost: ManagerLostState) -> None:
    """The block manager lost this engine's sequences (the prefill in flight already dropped):
    free whatever it may still hold of them (a Step that reached the new manager may have
    allocated some), renew the lease, and requeue every running and swapped sequence for recompute."""
    victims, frees = scheduler.take_block_holders()
    frees += lost.seq_ids
    session.lease_lost.clear()
    try:
        # Renew first (creating the lease is expected here), then free what the manager may hold.
        session.call(lambda t: session.keep_alive(timeout_s=t, first=True), needs_state=False)
        delta = session.free(frees)
    except BlockManagerUnavailable:
        scheduler.remote.unanswered(frees)  # freed by the first Step that gets through
        session.lease_lost.set()  # and the resync starts over then
        raise
    scheduler.remote.note_pool(delta)
    scheduler.requeue_all(victims)
    scheduler.stats.bm_resyncs += 1
    log.warning(
        "block_manager_resync",
        reason=str(lost),
        requeued=len(victims),
        freed=len(frees),
        action="re-allocating and recomputing",
    )
