"""bench/core_bench.py counts the same block operations for every allocator, only while timed,
commits as the engine does (so shared prefixes hit), and `--vllm` either adds vLLM's rows or says
clearly why it cannot."""

from __future__ import annotations

import re

import pytest

from bench import core_bench


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return core_bench


def test_every_allocator_counts_the_same_ops_on_the_same_trace(bench) -> None:  # type: ignore[no-untyped-def]
    naive = bench.run(lambda: bench.NaiveAllocator(bench.NUM_BLOCKS, bench.BLOCK_SIZE), False, False, 30, 3)
    paged = bench.run(lambda: bench.PagedKv(True, "lru"), True, False, 30, 3)
    assert naive["block_ops"] == paged["block_ops"] > 0
    # Only the timed steps count: the initial fill of 256 prompts (~40 blocks each) alone is more
    # than 30 steps of appends, frees and re-admissions add.
    fill = sum(
        bench.blocks_for(len(bench.Workload(3, False).next_request()[0])) for _ in range(bench.RUNNING)
    )
    assert paged["block_ops"] < fill


def test_pagedkv_commits_like_the_engine_so_prefixes_hit(bench) -> None:  # type: ignore[no-untyped-def]
    # The prefix cache serves only committed KV: without the harness's commits this reads 0%.
    paged = bench.run(lambda: bench.PagedKv(True, "lru"), True, True, 60, 3)
    naive = bench.run(lambda: bench.NaiveAllocator(bench.NUM_BLOCKS, bench.BLOCK_SIZE), False, True, 60, 3)
    assert paged["admitted"] > 0 and paged["block_ops"] == naive["block_ops"]
    # 512 shared tokens of ~600-token prompts: most admitted prompt tokens are hits.
    assert paged["hit_rate"] > 0.3
    # Without a shared prefix there is nothing to hit; the naive floor reports no hit rate at all.
    assert bench.run(lambda: bench.PagedKv(True, "lru"), True, False, 60, 3)["hit_rate"] == 0.0
    assert "hit_rate" not in naive


def table_rows(out: str) -> dict[str, list[str]]:
    """The printed table: {mode label: [mean, p50, p99, block ops/s, vs naive, hit rate, target]}."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] not in ("mode", "") and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    return rows


def test_vllm_rows_or_a_clear_skip(bench, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = bench.main(["--steps", "5", "--vllm"])
    out, err = capsys.readouterr()
    rows = table_rows(out)
    labels = [label for _, label, *_ in bench.ROWS]
    if bench.vllm_unavailable() is None:
        labels += [label for _, label, *_ in bench.VLLM_ROWS]  # the comparison rows, from this same run
        assert "vLLM KVCacheManager, prefix caching (sha256)" in out
    else:
        assert "--vllm: skipped, vLLM's KVCacheManager is not importable here" in err
        assert "vLLM" not in out
    assert list(rows) == labels, out
    assert out.count("| pagedkv") == 5 and "block ops counted per run" in out
    naive_mean = float(rows[labels[0]][0])
    missed = False
    for label, (mean, p50, p99, ops, vs, _hit, target) in rows.items():
        assert float(mean) > 0 and 0 < float(p50) <= float(p99) and float(ops.replace(",", "")) > 0, (
            label,
            out,
        )
        ratio = float(mean) / naive_mean  # both printed to 0.1 µs, the ratio to 0.01
        assert abs(float(vs.rstrip("x")) - ratio) <= 0.006 + ratio * (
            0.05 / naive_mean + 0.05 / float(mean)
        ), (label, vs, mean, naive_mean)
        if target:  # "<300 ok" / "<300 MISS": the verdict is the mean against the bound
            bound, verdict = target[1:].split()
            assert verdict == ("ok" if float(mean) < float(bound) else "MISS"), (label, mean, target)
            missed |= verdict == "MISS"
    # The exit code is the verdicts': 1 exactly when a target was missed.
    assert rc == (1 if missed else 0), (rc, out)
    ops_line = re.search(r"block ops counted per run \(same trace, every allocator\): (\d+)$", out, re.M)
    assert ops_line and int(ops_line.group(1)) > 0, out  # one count: every allocator did the same ops
