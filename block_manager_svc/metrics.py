"""Prometheus metrics of the block manager (docs/observability.md).

Off unless ``--metrics-port`` is set. Two parts:

- :class:`CoreCollector` reads the core's counters under the state lock at
  scrape time: the hot path pays nothing for pool, sequence, prefix-cache,
  eviction, preemption and swap numbers (and per-tenant ones with auth on);
- :class:`RpcMetricsInterceptor` counts every RPC by method, status code (and
  tenant, with auth on) and observes its latency in a histogram by method.

Everything goes to a private registry served on its own HTTP port
(``--metrics-host``, default 127.0.0.1), so several servers in one process
(tests) do not collide in prometheus_client's global registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedkv.auth import call_labels, current_tenant

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.servicer import BlockManagerServicer

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class CoreCollector(Collector):
    def __init__(self, servicer: BlockManagerServicer) -> None:
        self.servicer = servicer

    def collect(self) -> Iterator[Any]:
        sv = self.servicer
        with sv._lock:
            core = sv._core
            s = core.stats()
            ledger = core.tenants
            tenants = (
                {
                    t: (
                        u.gpu_blocks,
                        u.cpu_blocks,
                        u.sequences,
                        u.prefix_query_tokens,
                        u.prefix_hit_tokens,
                        u.preemptions,
                    )
                    for t, u in ledger.usage.items()
                }
                if ledger is not None
                else None
            )
            hub = sv.events_hub
            watchers = len(hub.subs) if hub is not None else 0
            version = hub.version if hub is not None else 0
        g = GaugeMetricFamily("pagedkv_gpu_blocks", "GPU KV blocks by state", labels=["state"])
        g.add_metric(["free"], s.num_free_blocks)
        g.add_metric(["cached"], s.num_cached_blocks)
        g.add_metric(["used"], s.num_used_blocks)
        yield g
        per_block, kv_dtype = core.config.kv_bytes_per_block, core.config.kv_cache_dtype
        g = GaugeMetricFamily(
            "pagedkv_kv_cache_bytes",
            "GPU KV cache bytes by block state: blocks x bytes per block (scales included)",
            labels=["state"],
        )
        g.add_metric(["free"], s.num_free_blocks * per_block)
        g.add_metric(["cached"], s.num_cached_blocks * per_block)
        g.add_metric(["used"], s.num_used_blocks * per_block)
        yield g
        g = GaugeMetricFamily(
            "pagedkv_kv_bytes_per_block", "bytes of one block, all layers, K and V", labels=["kv_cache_dtype"]
        )
        g.add_metric([kv_dtype], per_block)
        yield g
        g = GaugeMetricFamily("pagedkv_cpu_blocks", "CPU swap-pool blocks by state", labels=["state"])
        g.add_metric(["free"], s.num_free_cpu_blocks)
        g.add_metric(["used"], s.num_cpu_blocks - s.num_free_cpu_blocks)
        yield g
        g = GaugeMetricFamily("pagedkv_sequences", "live sequences by state", labels=["state"])
        g.add_metric(["running"], s.num_sequences - s.num_swapped_sequences)
        g.add_metric(["swapped"], s.num_swapped_sequences)
        yield g
        yield GaugeMetricFamily(
            "pagedkv_hashed_blocks", "blocks findable in the prefix cache", value=s.num_hashed_blocks
        )
        yield CounterMetricFamily(
            "pagedkv_prefix_query_tokens",
            "prompt tokens looked up in the prefix cache",
            value=s.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            "pagedkv_prefix_hit_tokens",
            "prompt tokens served from the prefix cache",
            value=s.prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "pagedkv_evicted_blocks", "cached blocks evicted", value=s.num_evicted_blocks
        )
        yield CounterMetricFamily("pagedkv_cow_copies", "copy-on-write block copies", value=s.num_cow_copies)
        c = CounterMetricFamily("pagedkv_preemptions", "sequences preempted, by kind", labels=["kind"])
        c.add_metric(["swap"], s.num_preemptions_swap)
        c.add_metric(["recompute"], s.num_preemptions_recompute)
        yield c
        c = CounterMetricFamily(
            "pagedkv_swapped_blocks", "blocks swapped, by direction", labels=["direction"]
        )
        c.add_metric(["out"], s.num_swapped_out_blocks)
        c.add_metric(["in"], s.num_swapped_in_blocks)
        yield c
        yield GaugeMetricFamily("pagedkv_event_watchers", "connected WatchEvents streams", value=watchers)
        yield CounterMetricFamily("pagedkv_kv_events", "KV events produced (the last version)", value=version)
        if tenants is not None:
            fams: list[GaugeMetricFamily | CounterMetricFamily] = [
                GaugeMetricFamily(
                    "pagedkv_tenant_gpu_blocks", "GPU blocks charged to a tenant", labels=["tenant"]
                ),
                GaugeMetricFamily(
                    "pagedkv_tenant_cpu_blocks", "CPU blocks charged to a tenant", labels=["tenant"]
                ),
                GaugeMetricFamily("pagedkv_tenant_sequences", "a tenant's live sequences", labels=["tenant"]),
                CounterMetricFamily(
                    "pagedkv_tenant_prefix_query_tokens",
                    "a tenant's prompt tokens looked up",
                    labels=["tenant"],
                ),
                CounterMetricFamily(
                    "pagedkv_tenant_prefix_hit_tokens", "a tenant's prompt tokens hit", labels=["tenant"]
                ),
                CounterMetricFamily(
                    "pagedkv_tenant_preemptions", "a tenant's sequences preempted", labels=["tenant"]
                ),
            ]
            for t, values in sorted(tenants.items()):
                for fam, v in zip(fams, values, strict=True):
                    fam.add_metric([t], v)
            yield from fams


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """RPC counts by (method, code, tenant) and latency by method. Put it first in the chain,
    so rejections by later interceptors (UNAUTHENTICATED) are counted too."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pagedkv_rpc_requests",
            "RPCs handled, by method, status code and tenant",
            ["method", "code", "tenant"],
            registry=registry,
        )
        self.latency = Histogram(
            "pagedkv_rpc_duration_seconds",
            "RPC handling time in the server, by method",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._hist: dict[str, Any] = {}
        self._counters: dict[tuple[str, str, str], Any] = {}

    def _count(self, method: str, code: str, tenant: str) -> None:
        key = (method, code, tenant)
        c = self._counters.get(key)
        if c is None:
            c = self._counters[key] = self.requests.labels(method, code, tenant)
        c.inc()

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        hist = self._hist.get(method)
        if hist is None:
            hist = self._hist[method] = self.latency.labels(method)
        count = self._count
        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }

        def code_of(context: Any, exc: BaseException | None) -> str:
            code = context.code() if hasattr(context, "code") else None
            if code is None:
                return "UNKNOWN" if exc is not None else "OK"
            return code.name if isinstance(code, grpc.StatusCode) else str(code)

        if handler.unary_unary is not None:
            fn = handler.unary_unary

            def unary(request: Any, context: Any) -> Any:
                labels: list[str] = []
                tok = call_labels.set(labels)
                t0 = time.perf_counter()
                exc: BaseException | None = None
                try:
                    return fn(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    hist.observe(time.perf_counter() - t0)
                    call_labels.reset(tok)
                    count(method, code_of(context, exc), labels[0] if labels else "")

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if handler.unary_stream is not None:
            sfn = handler.unary_stream

            def stream(request: Any, context: Any) -> Any:
                exc: BaseException | None = None
                try:
                    yield from sfn(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    tenant = current_tenant.get()  # streams: set by the auth wrapper inside
                    count(method, code_of(context, exc), tenant.name if tenant is not None else "")

            return grpc.unary_stream_rpc_method_handler(stream, **kw)
        return handler  # client-streaming methods (reflection): not measured


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.httpd, self.thread = start_http_server(port, addr=host, registry=registry)
        self.port = self.httpd.server_address[1]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def setup_metrics(servicer: BlockManagerServicer) -> tuple[CollectorRegistry, RpcMetricsInterceptor]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoreCollector(servicer))
    return registry, RpcMetricsInterceptor(registry)
