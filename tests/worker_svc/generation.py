"""A minimal scheduler for the tests: the block manager core decides, a worker step computes.

It plays the frontend's role: Allocate/Append through ``pagedkv.block_manager_svc.core.BlockManager``, and
hands every step's sequences (new tokens, block table, cached length) and cache ops to a ``step``
callable: an in-process ``ModelRunner`` or a gRPC ``Worker`` stub.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.worker_svc.model_runner import CacheOpsRequest, ModelRunner, SequenceRequest

# (sequences, ops) -> [(token_id, logprob)] in request order
StepFn = Callable[[list[SequenceRequest], CacheOpsRequest], list[tuple[int, float]]]


def runner_step(runner: ModelRunner) -> StepFn:
    def step(seqs: list[SequenceRequest], ops: CacheOpsRequest) -> list[tuple[int, float]]:
        return [(o.token_id, o.logprob) for o in runner.step(seqs, ops).outputs]

    return step


def grpc_step(stub: object) -> StepFn:
    from pagedkv.v1 import block_manager_pb2, worker_pb2

    def step(seqs: list[SequenceRequest], ops: CacheOpsRequest) -> list[tuple[int, float]]:
        req = worker_pb2.WorkerStepRequest(
            sequences=[
                worker_pb2.SequenceInput(
                    seq_id=s.seq_id,
                    token_ids=s.token_ids,
                    block_ids=s.block_ids,
                    num_cached_tokens=s.num_cached_tokens,
                    sampling=worker_pb2.SamplingParams(
                        temperature=s.sampling.temperature,
                        top_p=s.sampling.top_p,
                        top_k=s.sampling.top_k,
                        seed=s.sampling.seed,
                    ),
                )
                for s in seqs
            ],
            ops=block_manager_pb2.CacheOps(
                copies=[block_manager_pb2.BlockCopy(src=a, dst=b) for a, b in ops.copies],
                swap_out=[block_manager_pb2.BlockCopy(src=a, dst=b) for a, b in ops.swap_out],
                swap_in=[block_manager_pb2.BlockCopy(src=a, dst=b) for a, b in ops.swap_in],
            ),
        )
        resp = stub.Step(req, timeout=60)  # type: ignore[attr-defined]
        return [(o.token_id, o.logprob) for o in resp.outputs]

    return step


@dataclass(slots=True)
class SeqState:
    tokens: list[int]  # every token of the sequence (prompt + generated)
    num_cached: int  # tokens whose KV is in the cache
    generated: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, step: StepFn, num_gpu_blocks: int = 64, block_size: int = 4) -> None:
        self.bm = BlockManager(
            CoreConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size, preemption_mode="off")
        )
        self.step_fn = step
        self.seqs: dict[str, SeqState] = {}

    def add(self, seq_id: str, prompt: list[int]) -> int:
        """Allocate the prompt; returns the prefix-cache hit length."""
        res = self.bm.allocate(seq_id, len(prompt), token_ids=prompt)
        self.seqs[seq_id] = SeqState(tokens=list(prompt), num_cached=res.num_cached_tokens)
        return res.num_cached_tokens

    def fork(self, parent: str, child: str) -> None:
        self.bm.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = SeqState(
            tokens=list(p.tokens), num_cached=p.num_cached, generated=list(p.generated)
        )

    def push(self, seq_id: str, token: int) -> CacheOpsRequest:
        """Append a token chosen by the caller (not yet in the cache); returns the step's ops."""
        res = self.bm.append(seq_id, 1, token_ids=[token])
        self.seqs[seq_id].tokens.append(token)
        return CacheOpsRequest(
            copies=list(res.ops.copies), swap_out=list(res.ops.swap_out), swap_in=list(res.ops.swap_in)
        )

    def run(self, seq_ids: list[str], ops: CacheOpsRequest | None = None) -> list[tuple[int, float]]:
        """One worker step for these sequences: each sends its not-yet-cached tokens."""
        reqs = []
        for sid in seq_ids:
            st = self.seqs[sid]
            reqs.append(
                SequenceRequest(
                    seq_id=sid,
                    token_ids=st.tokens[st.num_cached :],
                    block_ids=self.bm.block_table(sid).block_ids,
                    num_cached_tokens=st.num_cached,
                )
            )
        outs = self.step_fn(reqs, ops or CacheOpsRequest())
        for sid, (tok, _) in zip(seq_ids, outs, strict=False):
            st = self.seqs[sid]
            st.num_cached = len(st.tokens)
            st.generated.append(tok)
            self.bm.commit(sid, st.num_cached)  # its KV is written: full blocks become prefix hits
        return outs

    def generate(self, seq_ids: list[str], n: int) -> None:
        """Greedy: n steps; each sequence sends its uncached tokens, else feeds back its last token."""
        for _ in range(n):
            ops = CacheOpsRequest()
            for sid in seq_ids:
                st = self.seqs[sid]
                if st.num_cached == len(st.tokens):
                    o = self.push(sid, st.generated[-1])
                    ops.copies += o.copies
                    ops.swap_out += o.swap_out
                    ops.swap_in += o.swap_in
            self.run(seq_ids, ops)
