"""The block manager SIGKILLed and restarted while an engine runs requests (real processes: block
manager, cache host, one worker), and a Step whose reply is lost.

- Restarted from its state dir: the engine retries its Step with the same request id (the manager
  answers from its restored dedupe table or applies it once) and just goes on: no resync.
- Restarted with no state dir (empty): the engine sees its lease created anew, re-allocates every
  sequence and recomputes the KV.
- A Step applied but whose reply never came back (injected by a client interceptor): the retry is
  answered from the dedupe table, never applied twice.

Each ends with every request's tokens equal to transformers' greedy generate(), GetStats showing 0
sequences and 0 used blocks, and a new request succeeding.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pagedkv.frontend.clients.block_manager import BlockManagerClient, channel_options
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest, RequestOutput
from pagedkv.frontend.launch.processes import Stack
from tests.frontend.process_stack import tiny_process_stack
from tests.worker_svc.conftest import HFModel, build_hf_model

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [5, 6, 7, 8, 20, 21],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [3, 1, 4, 1, 5, 9, 2, 6],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("tiny-llama-bm-faults"), seed=11)


@pytest.fixture(scope="module")
def greedy(hf: HFModel) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf.greedy(p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def stack(hf: HFModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with tiny_process_stack(
        str(hf.path),
        tmp_path_factory,
        {"PAGEDKV_KERNEL_BACKEND": "reference"},
        shm_prefix=f"pagedkv-bmf-{os.getpid()}",
        state_dir=str(tmp_path_factory.mktemp("bm-state")),
    ) as s:
        yield s


def _bm(stack: Stack) -> Any:
    return next(s for s in stack.services if s.name == "block-manager")


def _restart_bm(stack: Stack, *, keep_state: bool, down_s: float) -> threading.Thread:
    """SIGKILL the block manager now; restart it ``down_s`` later (in a thread, like a restart
    policy), with its state dir or as a fresh empty manager."""
    svc = _bm(stack)
    svc.process.send_signal(signal.SIGKILL)
    svc.process.wait(10)
    while not keep_state and "--state-dir" in svc.args:
        i = svc.args.index("--state-dir")
        del svc.args[i : i + 2]

    def later() -> None:
        time.sleep(down_s)
        stack.restart("block-manager")

    t = threading.Thread(target=later, daemon=True)
    t.start()
    return t


def _engine(stack: Stack, bm: BlockManagerClient | None = None) -> Engine:
    bm = bm or BlockManagerClient(_bm(stack).address)
    w = WorkerClient(next(s for s in stack.services if s.name == "worker-0").address)
    return Engine(bm, [w], EngineConfig(max_batch_tokens=64, block_manager_outage_s=20))


def _add(engine: Engine, tag: str) -> list[RequestOutput]:
    return [
        engine.add_request(GenerationRequest(f"{tag}{i}", p, max_tokens=MAX_TOKENS))
        for i, p in enumerate(PROMPTS)
    ]


def _check_clean_and_new_request(engine: Engine, greedy: dict[tuple[int, ...], list[int]], tag: str) -> None:
    stats = engine.bm.get_stats()
    assert (stats.num_sequences, stats.num_used_blocks) == (0, 0), stats
    out = engine.generate([GenerationRequest(f"{tag}-after", PROMPTS[1], max_tokens=MAX_TOKENS)])[0]
    assert out.completions[0].token_ids == greedy[tuple(PROMPTS[1])]
    stats = engine.bm.get_stats()
    assert (stats.num_sequences, stats.num_used_blocks) == (0, 0), stats


def _run_through_restart(
    stack: Stack, greedy: dict[tuple[int, ...], list[int]], keep_state: bool, tag: str
) -> Engine:
    eng = _engine(stack)
    outs = _add(eng, tag)
    for _ in range(6):
        eng.step()
    assert any(c.token_ids for o in outs for c in o.completions), "the fault must hit mid-generation"
    assert not all(o.finished for o in outs)
    t0 = time.monotonic()
    restarter = _restart_bm(stack, keep_state=keep_state, down_s=0.5)
    for _ in eng.stream(max_steps=10_000):
        pass
    restarter.join(30)
    assert time.monotonic() - t0 < 20
    for o, p in zip(outs, PROMPTS, strict=True):
        assert o.completions[0].token_ids == greedy[tuple(p)], o.request_id
    assert eng.stats.bm_retries >= 1
    assert eng.stats.longest_stall_s >= 0.4  # it waited for the restart, and rode it out
    _check_clean_and_new_request(eng, greedy, tag)
    return eng


def test_block_manager_sigkill_restart_from_state_dir_keeps_tokens(stack: Stack, greedy: Any) -> None:
    eng = _run_through_restart(stack, greedy, keep_state=True, tag="sd")
    assert eng.stats.bm_resyncs == 0, "a restored manager holds the engine's sequences: nothing to resync"
    assert eng.stats.recomputed_tokens == 0
    eng.close()


def test_block_manager_sigkill_restart_empty_resyncs_and_keeps_tokens(stack: Stack, greedy: Any) -> None:
    eng = _run_through_restart(stack, greedy, keep_state=False, tag="empty")
    assert eng.stats.bm_resyncs == 1
    assert eng.stats.recomputed_tokens > 0
    eng.close()


class _LostReply(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the reply was lost (injected)"


class _LoseStepReplies(grpc.UnaryUnaryClientInterceptor):
    """Let the manager apply a Step, then lose its reply: the first Step that allocates, and the
    first one that appends."""

    def __init__(self) -> None:
        self.lost: list[str] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if not details.method.endswith("/Step"):
            return outcome
        kind = "alloc" if request.alloc_seq_ids else "append" if request.append_seq_ids else ""
        if kind and kind not in self.lost:
            outcome.result()  # applied
            self.lost.append(kind)
            raise _LostReply()
        return outcome


def test_step_whose_reply_was_lost_is_not_applied_twice(stack: Stack, greedy: Any) -> None:
    before = BlockManagerClient(_bm(stack).address).get_stats().num_dedupe_hits
    lose = _LoseStepReplies()
    channel = grpc.intercept_channel(
        grpc.insecure_channel(_bm(stack).address, options=channel_options()), lose
    )
    eng = _engine(stack, BlockManagerClient(_bm(stack).address, channel=channel))
    outs = _add(eng, "lost")
    for _ in eng.stream(max_steps=10_000):
        pass
    assert lose.lost == ["alloc", "append"]
    for o, p in zip(outs, PROMPTS, strict=True):
        assert o.completions[0].token_ids == greedy[tuple(p)], o.request_id
    # Each lost reply was answered from the dedupe table (an allocation applied twice would have been
    # refused as ALREADY_EXISTS; an append applied twice would leave the manager a token ahead).
    assert eng.bm.get_stats().num_dedupe_hits - before >= 2
    _check_clean_and_new_request(eng, greedy, "lost")
    eng.close()
    channel.close()
