"""The stack's plan from the machine and the model: workers, their cores and threads, KV bytes,
sequences at once. What ``pagedkv up`` does with no flags, and what ``--print-plan`` shows.

A pure function of a described machine (``pagedkv/machine.py`` reads the real one) and the model's
sizes, so each rule is tested on machines the suite does not run on. The rules:

- **Compute threads never exceed the cores they run on.** The cores are the CPUs in the affinity
  mask, cut to the cgroup quota (a container given 1.5 CPUs computes on 1). Workers that share a
  machine get disjoint cores, pinned, and one compute thread per core they own: two OpenMP teams on
  one core make every parallel region wait for the slower of them.
- **One worker per NUMA node** (each on its node's cores, so its threads read local memory), and
  one worker on a single node: one team over every core serves one request with all of them and
  many requests with a whole batch per step, where two workers on a small machine leave one
  request half the cores. ``--num-workers`` more than the cores is planned down, with a warning.
- **The control plane keeps a core on larger machines**: from ``RESERVE_CORE_FROM`` cores up, the
  workers leave one core to the block manager, the front door and the engine, which run between
  (and beside) the forward passes; on a small machine a whole core idle most of a step costs more.
- **A GPU host runs one worker on the GPU** the cache host allocates the KV cache on (one pool per
  GPU: a second GPU is a second stack, ``deploy/``).
- **The KV cache is a byte budget**, ``KV_MEMORY_FRACTION`` of the memory left after the weights
  and the processes (on a GPU, of the GPU's memory after the weights, ``GPU_MEMORY_FRACTION`` of
  it in all, as vLLM's ``gpu_memory_utilization``), bounded by /dev/shm's free space on a CPU
  (where the cache lives) and by what every sequence at full length could use; ``--kv-cache-memory``
  or ``--num-gpu-blocks`` replace it.
- **Sequences at once** follow from the KV: each running sequence should have room for
  ``MIN_TOKENS_PER_SEQ`` tokens, up to ``MAX_SEQS_CPU`` per CPU worker (``MAX_SEQS_GPU`` on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv import defaults
from pagedkv.cpu_list import format_cpus
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.machine import Machine

GIB = 1 << 30
MIB = 1 << 20

RESERVE_CORE_FROM = 8
"""From this many compute cores up, the workers leave one to the control plane."""
KV_MEMORY_FRACTION = 0.4
"""Share of the memory left after weights and processes that the CPU KV cache takes by default."""
GPU_MEMORY_FRACTION = 0.9
"""Share of a GPU's memory the stack uses in all (weights + KV), as vLLM's default."""
PROCESS_BYTES = 256 * MIB
"""Memory held aside per process of the stack (interpreter, torch, buffers): not for the KV."""
MIN_TOKENS_PER_SEQ = 256
"""KV room each sequence at once should have; fewer blocks than this per sequence only preempt."""
MAX_SEQS_CPU = 64
"""Sequences at once per CPU worker: past this a decode step is compute-bound on a CPU."""
MAX_SEQS_GPU = 256
"""Sequences at once on a GPU (vLLM's default ``max_num_seqs``)."""
MIN_KV_BLOCKS = 16
"""Fewer blocks than this cannot serve a request of a few hundred tokens: refused, not planned."""


class PlanError(ValueError):
    """The machine cannot run what was asked (too little memory, CPUs not in the mask)."""


@dataclass(frozen=True, slots=True)
class ModelSize:
    """What the plan needs to know of the model."""

    weight_bytes: int
    """The weights as the workers hold them (a GGUF file's size for its own quantization)."""
    kv_bytes_per_block: int
    """One KV block over every layer, K and V (``pagedkv/kv_capacity.py``)."""
    block_size: int = defaults.BLOCK_SIZE
    max_model_len: int = 0
    """Longest sequence the model takes (0 = unknown)."""
    kv_groups: str = ""
    """The block manager's --kv-groups (empty: one table for every layer)."""
    layers_per_block: int = 0
    num_layers: int = 0
    """With groups, a block holds one group's layers: layers_per_block of num_layers."""
    draft_weight_bytes: int = 0
    """Speculative decoding's draft model (--speculative-model), which each worker loads itself."""


@dataclass(frozen=True, slots=True)
class Asked:
    """What the user set by hand; None = plan it."""

    device: str = "auto"  # auto | cpu | cuda[:N]
    num_workers: int | None = None
    num_threads: int | None = None  # per worker
    pin: bool = True  # pin CPU workers to their cores
    kv_cache_memory_gib: float | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    processes: int = 3  # the stack's processes beside the workers: block manager, cache host, serve


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    cpus: tuple[int, ...]
    """The cores it is pinned to; () = not pinned (inherits the launcher's mask)."""
    threads: int
    """Its compute threads (torch's and the native kernels' OpenMP team)."""


@dataclass(frozen=True, slots=True)
class Plan:
    device: str  # "cpu" or "cuda"
    workers: tuple[WorkerPlan, ...]
    kv_cache_bytes: int
    num_gpu_blocks: int
    kv_bytes_per_block: int
    max_num_seqs: int
    compute_cores: int
    """The cores the workers' threads may use in all (affinity cut to the quota, less a reserve)."""
    reasons: tuple[str, ...] = ()
    """Why each choice was made, one line each."""
    kv_groups: str = ""
    """ModelSize.kv_groups, and its line: the groups and the layers a block holds."""
    kv_groups_line: str = ""
    warnings: tuple[str, ...] = field(default=())
    """Where a request was planned down."""

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def lines(self) -> list[str]:
        """The plan as ``up`` prints it: one line per worker, then the pool and the front door."""
        out = []
        for i, w in enumerate(self.workers):
            where = f"cores {format_cpus(w.cpus)} (pinned)" if w.cpus else "cores: inherited"
            out.append(f"worker-{i:<8} {self.device}, {where}, {w.threads} compute threads")
        out.append(
            f"{'KV cache':<15} {self.num_gpu_blocks} blocks x {self.kv_bytes_per_block} B = "
            f"{self.kv_cache_bytes / MIB:.0f} MiB"
        )
        if self.kv_groups:
            out.append(f"{'KV groups':<15} {self.kv_groups}: {self.kv_groups_line}")
        out.append(f"{'frontend':<15} max {self.max_num_seqs} sequences at once")
        return out


def compute_cpus(machine: Machine) -> tuple[int, ...]:
    """The CPUs compute may use: the mask, cut to the quota (whole CPUs, at least one), taken node
    by node so a cut keeps a worker's cores on one node."""
    cpus = machine.cpus
    if not cpus:
        raise PlanError("this process may run on no CPU (empty affinity mask)")
    want = len(cpus)
    if machine.cpu_quota is not None:
        want = max(1, min(want, math.floor(machine.cpu_quota + 1e-9)))
    ordered = [c for node in _nodes(machine) for c in node]
    return tuple(sorted(ordered[:want]))


def _nodes(machine: Machine) -> list[tuple[int, ...]]:
    """The mask's CPUs grouped by NUMA node (one group when the nodes are unknown)."""
    allowed = set(machine.cpus)
    nodes = [tuple(c for c in node if c in allowed) for node in machine.numa_nodes]
    nodes = [n for n in nodes if n]
    known = {c for n in nodes for c in n}
    rest = tuple(c for c in machine.cpus if c not in known)
    return nodes + [rest] if rest else nodes or [tuple(machine.cpus)]


def split(cpus: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """``cpus`` in ``n`` contiguous, disjoint groups whose sizes differ by at most one."""
    base, extra = divmod(len(cpus), n)
    groups, at = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        groups.append(cpus[at : at + size])
        at += size
    return groups


def plan_cpu_workers(machine: Machine, asked: Asked) -> tuple[list[WorkerPlan], int, list[str], list[str]]:
    """The CPU workers: (workers, compute cores, reasons, warnings)."""
    reasons: list[str] = []
    warnings: list[str] = []
    cpus = compute_cpus(machine)
    if len(cpus) < len(machine.cpus):
        reasons.append(
            f"the CPU quota ({machine.cpu_quota:g}) allows {len(cpus)} of the {len(machine.cpus)} CPUs "
            "in the mask: compute threads on that many"
        )
    if len(cpus) >= RESERVE_CORE_FROM:
        cpus = cpus[:-1]
        reasons.append(
            f"one core left to the block manager, front door and engine ({RESERVE_CORE_FROM}+ cores)"
        )
    allowed = set(cpus)
    node_groups = [tuple(c for c in node if c in allowed) for node in _nodes(machine)]
    node_groups = [g for g in node_groups if g]
    if asked.num_workers is None:
        n = len(node_groups)
        reasons.append(
            f"{n} worker(s): one per NUMA node"
            if n > 1
            else "1 worker: one team of threads over every core serves one request with all of them "
            "and a whole batch per step"
        )
    else:
        n = asked.num_workers
        if n > len(cpus):
            warnings.append(
                f"--num-workers {n} on {len(cpus)} cores would put two compute teams on one core: "
                f"planned {len(cpus)} workers, one core each"
            )
            n = len(cpus)
    groups = node_groups if n == len(node_groups) else split(cpus, n)
    workers = []
    for group in groups:
        threads = len(group)
        if asked.num_threads is not None:
            if asked.num_threads > len(group):
                warnings.append(
                    f"--num-threads {asked.num_threads} is more than a worker's {len(group)} cores: "
                    f"planned {len(group)}"
                )
            else:
                threads = asked.num_threads
                group = group[:threads]
        workers.append(WorkerPlan(cpus=group if asked.pin else (), threads=threads))
    if not asked.pin:
        warnings.append("workers not pinned (--no-pin-workers): their threads may share cores")
    return workers, len(cpus), reasons, warnings


def _max_useful_kv(model: ModelSize, max_seqs: int) -> int:
    """Bytes of KV every sequence at once could use at the model's full length (0 = unbounded)."""
    if model.max_model_len <= 0:
        return 0
    blocks = max_seqs * blocks_for_tokens(model.max_model_len, model.block_size)
    return blocks * model.kv_bytes_per_block * _groups(model)


def _groups(model: ModelSize) -> int:
    """KV-cache groups: a block holds one group's layers, and a sequence takes a table in each
    (a bound: a window group's holds only its window's blocks)."""
    return model.num_layers // model.layers_per_block if model.kv_groups and model.layers_per_block else 1


def plan_stack(machine: Machine, model: ModelSize, asked: Asked | None = None) -> Plan:
    """The plan for a stack of this model on this machine (raises PlanError when it cannot run)."""
    asked = asked or Asked()
    if model.kv_bytes_per_block < 1 or model.block_size < 1:
        raise PlanError(f"bad model sizes: {model}")
    gpu = asked.device.startswith("cuda") or (asked.device == "auto" and bool(machine.gpus))
    if asked.device.startswith("cuda") and not machine.gpus:
        raise PlanError(f"--device {asked.device}: no GPU is visible here")
    reasons: list[str] = []
    warnings: list[str] = []
    if gpu:
        cpus = compute_cpus(machine)
        n = min(asked.num_workers or 1, len(cpus))
        workers = [WorkerPlan(cpus=g if asked.pin else (), threads=len(g)) for g in split(cpus, n)]
        reasons.append("1 worker on the GPU that holds the KV cache (one pool per GPU)")
        compute_cores = len(cpus)
    else:
        cpu_workers, compute_cores, r, w = plan_cpu_workers(machine, asked)
        workers, reasons, warnings = cpu_workers, reasons + r, warnings + w
    seq_cap = MAX_SEQS_GPU if gpu else MAX_SEQS_CPU * len(workers)
    per_block = model.kv_bytes_per_block

    if asked.num_gpu_blocks is not None:
        blocks = asked.num_gpu_blocks
        reasons.append(f"{blocks} KV blocks as asked (--num-gpu-blocks)")
    elif asked.kv_cache_memory_gib is not None:
        blocks = int(asked.kv_cache_memory_gib * GIB) // per_block
        reasons.append(f"KV cache of {asked.kv_cache_memory_gib:g} GiB as asked (--kv-cache-memory)")
    else:
        if gpu:
            room = int(machine.gpus[0] * GPU_MEMORY_FRACTION) - model.weight_bytes - model.draft_weight_bytes
            what = f"{GPU_MEMORY_FRACTION:.0%} of the GPU's {machine.gpus[0] / GIB:.0f} GiB less the weights"
        else:
            held = (
                model.weight_bytes
                + model.draft_weight_bytes * len(workers)
                + PROCESS_BYTES * (len(workers) + asked.processes)
            )
            room = int((machine.memory_available - held) * KV_MEMORY_FRACTION)
            what = (
                f"{KV_MEMORY_FRACTION:.0%} of the {machine.memory_available / GIB:.1f} GiB available "
                "less the weights and processes"
            )
            if machine.shm_available is not None and machine.shm_available - model.weight_bytes < room:
                room = int((machine.shm_available - model.weight_bytes) * 0.9)
                what = f"90% of /dev/shm's {machine.shm_available / GIB:.1f} GiB free less the weights"
        useful = _max_useful_kv(model, asked.max_num_seqs or seq_cap)
        if useful and useful < room:
            room = useful
            what = f"every sequence at once at the model's full length ({model.max_model_len} tokens)"
        blocks = max(0, room) // per_block
        reasons.append(f"KV cache: {what}")
        if blocks < MIN_KV_BLOCKS:
            raise PlanError(
                f"too little memory for a KV cache: {max(0, room) / MIB:.0f} MiB after the weights "
                f"({model.weight_bytes / MIB:.0f} MiB) is {blocks} blocks of {per_block} bytes, fewer than "
                f"{MIN_KV_BLOCKS}; free memory, or set --kv-cache-memory / --num-gpu-blocks"
            )
    if blocks < 1:
        raise PlanError(f"the KV cache would hold {blocks} blocks: give at least 1")

    if asked.max_num_seqs is not None:
        max_seqs = asked.max_num_seqs
    else:
        by_kv = max(1, blocks * model.block_size // (MIN_TOKENS_PER_SEQ * _groups(model)))
        max_seqs = min(seq_cap, by_kv)
        reasons.append(
            f"max {max_seqs} sequences at once: "
            + (
                f"{MIN_TOKENS_PER_SEQ} tokens of KV each"
                if by_kv < seq_cap
                else f"{MAX_SEQS_GPU} on a GPU"
                if gpu
                else f"{MAX_SEQS_CPU} per CPU worker"
            )
        )
    return Plan(
        device="cuda" if gpu else "cpu",
        workers=tuple(workers),
        kv_cache_bytes=blocks * per_block,
        num_gpu_blocks=blocks,
        kv_bytes_per_block=per_block,
        max_num_seqs=max_seqs,
        compute_cores=compute_cores,
        reasons=tuple(reasons),
        warnings=tuple(warnings),
        kv_groups=model.kv_groups,
        kv_groups_line=(
            f"one block table per group, a block holds {model.layers_per_block} of the "
            f"{model.num_layers} layers ({per_block} B)"
            if model.kv_groups
            else ""
        ),
    )
