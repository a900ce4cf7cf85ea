"""The scheduler without servers: the block manager's real core and Step handler in-process, and a
deterministic stand-in for the workers, driven the way the engine drives them (plan, call, apply).

The stand-in "model" samples each token as a function of every token before it, so a sequence
that is preempted and recomputed must come out with exactly the tokens it would have had. Its
"KV cache" is real bookkeeping: each step writes its tokens into the slots its block table names
(after the cache ops: swap-out, copies, swap-in) and reads the whole context back through that
table, so a wrong table, a missed copy or a block used ahead of the manager's say changes tokens."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.handlers import CoreStage
from pagedkv.frontend.engine.beam import BeamParams
from pagedkv.frontend.engine.policy import Limits
from pagedkv.frontend.engine.scheduler import PrefillItem, Scheduler
from pagedkv.frontend.engine.speculate import SpeculativeConfig
from pagedkv.frontend.engine.step_messages import StepDelta, StepPlan, step_delta, step_request
from pagedkv.frontend.engine.types import EngineStats, GenerationRequest, SamplingOptions, Seq, TokenEvent
from pagedkv.v1 import worker_pb2 as wpb

VOCAB = 97


def next_token(tokens: list[int], seed: int = 0) -> int:
    """The stand-in model: a pure function of the context (and the sample's seed)."""
    h = seed * 1_000_003
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_000_007
    return h % VOCAB


def candidates(tokens: list[int], k: int) -> list[tuple[int, float]]:
    """The stand-in model's k most likely next tokens with their log-softmax (what a worker
    reports for a beam, and for top logprobs): a distribution that is a pure function of the
    context, most likely first."""
    rng = random.Random(next_token(tokens, 7) * 1_000_003 + len(tokens))
    logits = [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]
    norm = math.log(sum(math.exp(x) for x in logits))
    order = sorted(range(VOCAB), key=lambda t: (-logits[t], t))[:k]
    return [(t, logits[t] - norm) for t in order]


def expected(
    prompt: list[int], max_tokens: int, seed: int = 0, model: Callable[[list[int], int], int] = next_token
) -> list[int]:
    """What a request generates with nothing in the way (no preemption, no fault)."""
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        t = model(ctx, seed)
        out.append(t)
        ctx.append(t)
    return out


class _Context:
    """Enough of a gRPC context for the handler to refuse a whole request."""

    def abort(self, code: object, message: str) -> None:
        raise RuntimeError(f"{code}: {message}")


class CoreBlockManager:
    """The block manager's core behind its own Step handler (block_manager_svc/handlers.py), with
    the engine's own wire translation (step_messages.py) on both sides: no server, no gRPC."""

    def __init__(self, **config: object) -> None:
        self.core = BlockManager(CoreConfig(**config))  # type: ignore[arg-type]
        self.stage = CoreStage(self.core, threading.RLock())
        self.steps: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepDelta:
        self.steps.append(plan)
        resp = self.stage.Step(step_request(plan, "lease-test"), _Context())
        return step_delta(resp, len(plan.allocs))

    def num_sequences(self) -> int:
        return self.core.stats().num_sequences

    def blocks_in_use(self) -> int:
        """Blocks some sequence references (cached, unreferenced blocks are available)."""
        return self.core.config.num_gpu_blocks - self.core.pool.num_available


@dataclass
class Driver:
    """One engine iteration at a time: the block-manager Step, then one worker step."""

    scheduler: Scheduler
    bm: CoreBlockManager
    events: list[TokenEvent] = field(default_factory=list)
    worker_steps: list[list[tuple[str, int]]] = field(default_factory=list)
    ops_sent: int = 0
    decode_steps: int = 1  # EngineConfig.decode_steps: the stand-in worker runs them as the real one
    # The real worker ends a sequence's steps at a stop token; False: this one runs every step it
    # was asked for (a reply that carries tokens past the one that finished the sequence).
    worker_stops: bool = True
    # The stand-in model (speculative tests use one that repeats its context, so proposals match).
    model: Callable[[list[int], int], int] = next_token
    # Verification passes: (seq id, tokens proposed, tokens accepted), as the real worker verifies.
    verified: list[tuple[str, int, int]] = field(default_factory=list)
    gpu: dict[int, dict[int, int]] = field(default_factory=dict)  # block -> slot -> token written
    cpu: dict[int, dict[int, int]] = field(default_factory=dict)

    @classmethod
    def make(
        cls, *, num_gpu_blocks: int, block_size: int = 4, max_num_seqs: int = 8, max_batch_tokens: int = 64,
        watermark: int = 0, prefix_caching: bool = True, defer_appends: bool = True,
        grant_ahead_tokens: int | None = None, decode_steps: int = 1,
        speculative: SpeculativeConfig | None = None, **core: object,
    ) -> Driver:  # fmt: skip
        bm = CoreBlockManager(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            watermark_blocks=watermark,
            enable_prefix_caching=prefix_caching,
            **core,
        )
        limits = Limits(max_num_seqs, max_batch_tokens, block_size, watermark, prefix_caching)
        stats = EngineStats()
        scheduler = Scheduler(
            limits,
            num_gpu_blocks,
            "test",
            stats,
            defer_appends=defer_appends,
            grant_ahead_tokens=grant_ahead_tokens,
            speculative=speculative,
        )
        return cls(scheduler, bm, decode_steps=decode_steps)

    def add(
        self, rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1, seed: int | None = None,
        stop_token_ids: tuple[int, ...] = (), priority: int = 0, beam: BeamParams | None = None,
    ) -> None:  # fmt: skip
        sampling = SamplingOptions(temperature=0.0 if seed is None else 1.0, seed=seed)
        request = GenerationRequest(
            rid,
            prompt,
            max_tokens=max_tokens,
            n=n,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            priority=priority,
            beam=beam,
        )
        request.validate(VOCAB)
        self.scheduler.add(request)

    def block_manager_step(self) -> StepDelta | None:
        plan = self.scheduler.plan()
        if plan is None:
            return None
        delta = self.bm.step(plan.step)
        self.scheduler.apply_block_manager(plan, delta)
        return delta

    def worker_step(self) -> list[TokenEvent]:
        sched = self.scheduler
        decode, prefill = sched.batches(separate_budgets=False, num_workers=1, prefill_busy=False)
        batch = decode + prefill
        ops = sched.remote.take_ops()
        self.ops_sent += len(ops.copies) + len(ops.swap_out) + len(ops.swap_in)
        for src, dst in ((c.src, c.dst) for c in ops.swap_out):
            self.cpu[dst] = dict(self.gpu.get(src, {}))
        for src, dst in ((c.src, c.dst) for c in ops.copies):
            self.gpu[dst] = dict(self.gpu.get(src, {}))
        for src, dst in ((c.src, c.dst) for c in ops.swap_in):
            self.gpu[dst] = dict(self.cpu.get(src, {}))
        if not batch:
            return []
        self.worker_steps.append([(s.seq_id, k) for s, k in batch])
        items = [PrefillItem(s, s.num_computed, k) for s, k in batch]
        steps = sched.decode_steps(batch, self.decode_steps) or [1] * len(batch)
        outputs = []
        bs = sched.limits.block_size
        for (s, k), n in zip(batch, steps, strict=True):
            table = s.blocks.step_table  # what the worker request carries
            for pos in range(s.num_computed, s.num_computed + k):
                self.gpu.setdefault(table[pos // bs], {})[pos % bs] = s.tokens[pos]
            if s.proposed and s.num_computed + k == len(s.tokens):
                outputs.append(self._verify(s, k, table))
                continue
            context = [self.gpu[table[pos // bs]].get(pos % bs, -1) for pos in range(s.num_computed + k)]
            draws = sched.fork_draws(s, k)
            out = wpb.SequenceOutput(token_id=self.model(context, s.seed or 0))
            num_top = s.request.step_sampling.logprobs  # (a beam's: its candidates)
            if num_top:
                top = candidates(context, num_top)
                out.top_token_ids.extend(t for t, _ in top)
                out.top_logprobs.extend(lp for _, lp in top)
            for child in draws:
                out.fork_samples.add(token_id=self.model(context, child.seed or 0))
            # Multi-step decode: each next step writes the token drawn last at the next position
            # (into the table it was sent: a slot it does not hold raises here) and draws again.
            last, pos = out.token_id, s.num_computed + k
            for _ in range(n - 1):
                if self.worker_stops and last in s.request.stop_token_ids:
                    break
                self.gpu.setdefault(table[pos // bs], {})[pos % bs] = last
                pos += 1
                context = [self.gpu[table[q // bs]].get(q % bs, -1) for q in range(pos)]
                last = self.model(context, s.seed or 0)
                out.next_samples.add(token_id=last)
            outputs.append(out)
        events = sched.apply_outputs(items, outputs)
        self.events += events
        return events

    def _verify(self, s: Seq, k: int, table: list[int]) -> wpb.SequenceOutput:
        """A verification pass as the worker runs it: the model's own token after each of the k
        new tokens (read back through the table), the proposals kept while they agree with it."""
        bs = self.scheduler.limits.block_size
        start = s.num_computed
        draws = []
        for j in range(k):
            context = [self.gpu[table[q // bs]].get(q % bs, -1) for q in range(start + j + 1)]
            draws.append(self.model(context, s.seed or 0))
        proposals = s.tokens[start + 1 : start + k]
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == draws[accepted]:
            accepted += 1
        self.verified.append((s.seq_id, len(proposals), accepted))
        kept = draws[: accepted + 1]
        out = wpb.SequenceOutput(token_id=kept[0], num_accepted_tokens=accepted)
        for t in kept[1:]:
            out.next_samples.add(token_id=t)
        return out

    def iterate(self) -> list[TokenEvent]:
        self.block_manager_step()
        return self.worker_step()

    def run(self, max_iterations: int = 500) -> None:
        for _ in range(max_iterations):
            if not self.scheduler.has_work():
                return
            self.iterate()
        raise AssertionError(f"still running after {max_iterations} iterations")

    def tokens(self, rid: str, index: int = 0) -> list[int]:
        return self.scheduler.outputs[rid].completions[index].token_ids

    def assert_nothing_held(self) -> None:
        """Everything finished was freed: the manager holds no sequence and no referenced block."""
        for _ in range(2):  # the frees of the last iteration (a flush: their owed appends first)
            plan = self.scheduler.plan(full=False)
            if plan is not None:
                self.scheduler.apply_block_manager(plan, self.bm.step(plan.step))
        assert self.bm.num_sequences() == 0
        assert self.bm.blocks_in_use() == 0
        self.bm.core.check_invariants()
