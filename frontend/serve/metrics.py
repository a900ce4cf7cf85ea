"""Prometheus metrics of `pagedkv serve` (docs/serve.md), with vLLM's meanings.

`pagedkv_` names always; with ``vllm_names`` the six series that the Kubernetes inference
gateway and vLLM dashboards scrape are also exported under vLLM's exact names
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds``), so scrapers built for vLLM work unchanged.

Meanings (as in vLLM):
- waiting / running: requests queued but holding no blocks / requests whose samples hold blocks.
- kv_cache_usage_perc: a FRACTION in [0, 1]: blocks referenced by a sequence / GPU blocks, read
  from the block manager's GetStats at scrape time (the pool may be shared by several frontends).
- time_to_first_token: arrival at the server to the first token of the request.
- time_per_output_token: each gap between two consecutive tokens of one sample (after the first).
- e2e_request_latency: arrival to the last token.
Own additions: the model's resident weight bytes (from the first worker's GetWorkerInfo at
start-up, labelled with its --weight-format), KV blocks used, prefix-cache queries/hits (prompt
tokens), engine iterations and how many requests got a token in each (proves batching), tokens
and finished requests by reason, and the faults the engine rode out (block-manager
retries/resyncs, cache-host recoveries, recomputed tokens, the longest stall).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _PoolCollector(Collector):
    """KV blocks used and the usage fraction, read from the block manager when scraped."""

    def __init__(self, read: Callable[[], tuple[int, int] | None], vllm_names: bool) -> None:
        self._read = read
        self._vllm = vllm_names

    def collect(self) -> Iterator[GaugeMetricFamily]:
        got = self._read()
        if got is None:
            return
        used, total = got
        frac = used / total if total else 0.0
        yield GaugeMetricFamily(
            "pagedkv_kv_cache_used_blocks", "KV blocks referenced by a sequence", value=used
        )
        yield GaugeMetricFamily(
            "pagedkv_kv_cache_usage_perc",
            "KV-cache usage as a fraction (1 = full): used blocks / GPU blocks",
            value=frac,
        )
        if self._vllm:
            yield GaugeMetricFamily(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", value=frac
            )


class _FaultCollector(Collector):
    """What the engine rode out (EngineStats, read when scraped): block-manager retries and resyncs,
    cache-host recoveries, tokens recomputed because their KV was lost, the longest stall."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._read()
        yield CounterMetricFamily(
            "pagedkv_block_manager_retries",
            "Block-manager calls retried after UNAVAILABLE/DEADLINE_EXCEEDED",
            value=st.bm_retries,
        )
        yield CounterMetricFamily(
            "pagedkv_block_manager_resyncs",
            "Times the engine re-established its sequences with a block manager that had lost them",
            value=st.bm_resyncs,
        )
        yield CounterMetricFamily(
            "pagedkv_cache_host_recoveries",
            "Cache-host losses the engine recovered from",
            value=st.cache_recoveries,
        )
        yield CounterMetricFamily(
            "pagedkv_recomputed_tokens",
            "Tokens whose KV was lost and computed again",
            value=st.recomputed_tokens,
        )
        yield GaugeMetricFamily(
            "pagedkv_block_manager_longest_stall_seconds",
            "Longest time the engine waited for an unreachable block manager",
            value=st.longest_stall_s,
        )


class _SpeculationCollector(Collector):
    """Speculative decoding's counters (EngineStats, read when scraped), with vLLM's names beside
    ours: verification passes, proposed and accepted tokens, tokens the passes produced; and the
    acceptance rate and tokens per pass they make."""

    def __init__(self, read: Callable[[], Any], vllm_names: bool) -> None:
        self._read = read
        self._vllm = vllm_names

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._read()
        counters = (
            ("spec_decode_num_drafts", "Verification passes (speculative decoding)", st.spec_passes),
            ("spec_decode_num_draft_tokens", "Proposed tokens verified", st.spec_proposed),
            ("spec_decode_num_accepted_tokens", "Proposed tokens accepted", st.spec_accepted),
            ("spec_decode_num_emitted_tokens", "Tokens verification passes produced", st.spec_emitted),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"pagedkv_{name}", doc, value=value)
            if self._vllm and name != "spec_decode_num_emitted_tokens":
                yield CounterMetricFamily(f"vllm:{name}", doc, value=value)
        yield GaugeMetricFamily(
            "pagedkv_spec_decode_acceptance_rate",
            "Accepted / proposed tokens so far",
            value=st.spec_accepted / st.spec_proposed if st.spec_proposed else 0.0,
        )
        yield GaugeMetricFamily(
            "pagedkv_spec_decode_tokens_per_pass",
            "Tokens per verification pass so far (accepted + the target's own)",
            value=st.spec_emitted / st.spec_passes if st.spec_passes else 0.0,
        )


class ServeMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(
        self,
        model_name: str,
        pool: Callable[[], tuple[int, int] | None],
        vllm_names: bool = False,
        engine_stats: Callable[[], Any] | None = None,
    ) -> None:
        self.registry = r = CollectorRegistry()
        self.vllm_names = vllm_names
        labels = ["model_name"]
        self._model = model_name
        self.waiting = Gauge(
            "pagedkv_num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r
        )
        self.running = Gauge("pagedkv_num_requests_running", "Requests holding KV blocks", labels, registry=r)
        self.ttft = Histogram(
            "pagedkv_time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pagedkv_time_per_output_token_seconds",
            "Time between consecutive output tokens of one sample",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedkv_e2e_request_latency_seconds",
            "Arrival to last token",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedkv_prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        )
        self.generation_tokens = Counter("pagedkv_generation_tokens", "Generated tokens", labels, registry=r)
        self.prefix_queries = Counter(
            "pagedkv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_hits = Counter(
            "pagedkv_prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r
        )
        self.finished = Counter(
            "pagedkv_request_success",
            "Finished requests by finish reason",
            labels + ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "pagedkv_request_rejected",
            "Requests refused before admission, by HTTP status",
            labels + ["status"],
            registry=r,
        )
        self.iterations = Counter(
            "pagedkv_engine_iterations", "Engine iterations (steps)", labels, registry=r
        )
        self.iteration_requests = Histogram(
            "pagedkv_iteration_requests",
            "Requests that received a token in one engine iteration",
            labels,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.weight_bytes = Gauge(
            "pagedkv_model_weight_bytes",
            "Resident bytes of the model weights a worker computes with (packed integers and scales "
            "when quantized; one copy when the cache host shares them)",
            labels + ["weight_format"],
            registry=r,
        )
        r.register(_PoolCollector(pool, vllm_names))
        if engine_stats is not None:
            r.register(_FaultCollector(engine_stats))
            r.register(_SpeculationCollector(engine_stats, vllm_names))
        self._vllm: dict[str, Gauge | Histogram] = {}
        if vllm_names:
            self._vllm = {
                "waiting": Gauge(
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    labels,
                    registry=r,
                ),
                "running": Gauge(
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    labels,
                    registry=r,
                ),
                "ttft": Histogram(
                    "vllm:time_to_first_token_seconds",
                    "Histogram of time to first token in seconds.",
                    labels,
                    buckets=TTFT_BUCKETS,
                    registry=r,
                ),
                "tpot": Histogram(
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds.",
                    labels,
                    buckets=TPOT_BUCKETS,
                    registry=r,
                ),
                "e2e": Histogram(
                    "vllm:e2e_request_latency_seconds",
                    "Histogram of end to end request latency in seconds.",
                    labels,
                    buckets=E2E_BUCKETS,
                    registry=r,
                ),
            }

    def set_queues(self, waiting: int, running: int) -> None:
        self.waiting.labels(self._model).set(waiting)
        self.running.labels(self._model).set(running)
        if self._vllm:
            self._vllm["waiting"].labels(self._model).set(waiting)  # type: ignore[union-attr]
            self._vllm["running"].labels(self._model).set(running)  # type: ignore[union-attr]

    def observe_ttft(self, s: float) -> None:
        self.ttft.labels(self._model).observe(s)
        if self._vllm:
            self._vllm["ttft"].labels(self._model).observe(s)  # type: ignore[union-attr]

    def observe_tpot(self, s: float) -> None:
        self.tpot.labels(self._model).observe(s)
        if self._vllm:
            self._vllm["tpot"].labels(self._model).observe(s)  # type: ignore[union-attr]

    def observe_finished(
        self, e2e_s: float, prompt_tokens: int, cached_tokens: int, reasons: list[str]
    ) -> None:
        m = self._model
        self.e2e.labels(m).observe(e2e_s)
        if self._vllm:
            self._vllm["e2e"].labels(m).observe(e2e_s)  # type: ignore[union-attr]
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.prefix_queries.labels(m).inc(prompt_tokens)
        self.prefix_hits.labels(m).inc(cached_tokens)
        for reason in reasons:
            self.finished.labels(m, reason).inc()

    def observe_abort(self) -> None:
        """A request ended by its client (disconnect) before it finished."""
        self.finished.labels(self._model, "abort").inc()

    def observe_iteration(self, requests_with_tokens: int, tokens: int) -> None:
        self.iterations.labels(self._model).inc()
        self.generation_tokens.labels(self._model).inc(tokens)
        if requests_with_tokens:
            self.iteration_requests.labels(self._model).observe(requests_with_tokens)

    def reject(self, status: int) -> None:
        self.rejected.labels(self._model, str(status)).inc()
