"""Prometheus metrics: one CollectorRegistry per app (never the global one), so that tests that
build many apps never see each other's numbers.

Requests are counted by a middleware (every path, every status, a 401 or 413 included);
generations are observed through the service; queue depth and memory are read when scraped.
"""

from __future__ import annotations

import time

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.base import RequestStats

# Decode speeds span a 135M model on a CPU to an 8B one on an H200.
_TOKS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A request whose client left before any response: nginx's name for it.
CLIENT_CLOSED = "499"


class ServerMetrics:
    def __init__(self, model_registry):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "duet_requests", "HTTP requests by endpoint (route template), method and status",
            ["endpoint", "method", "status"], registry=self.registry,
        )
        self.request_seconds = Histogram(
            "duet_request_duration_seconds", "Time to the end of the response, by endpoint",
            ["endpoint"], registry=self.registry,
        )
        self.tokens = Counter(
            "duet_tokens", "Tokens processed, by model, engine and kind (prompt or completion)",
            ["model", "engine", "kind"], registry=self.registry,
        )
        self.ttft = Histogram(
            "duet_time_to_first_token_seconds", "Time to first token (prefill), per engine",
            ["model", "engine"], buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.decode_speed = Histogram(
            "duet_decode_tokens_per_second", "Decode speed of each generation, per engine",
            ["model", "engine"], buckets=_TOKS_BUCKETS, registry=self.registry,
        )
        self.peak_memory = Gauge(
            "duet_engine_peak_memory_bytes", "Peak memory of the engine's latest generation",
            ["model", "engine"], registry=self.registry,
        )
        self.kv_cache = Gauge(
            "duet_generation_kv_cache_bytes", "KV cache bytes the latest generation held",
            ["model", "engine"], registry=self.registry,
        )
        self.cached_tokens = Counter(
            "duet_prompt_tokens_cached", "Prompt tokens whose KV came from the prefix cache "
            "instead of a prefill", ["model", "engine"], registry=self.registry,
        )
        self.queue_time = Histogram(
            "duet_queue_seconds", "Time from a generation's arrival to its first scheduled step",
            ["model", "engine"], buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.registry.register(_LiveCollector(model_registry))

    def observe_generation(self, model: str, engine: str, stats: RequestStats) -> None:
        self.tokens.labels(model, engine, "prompt").inc(stats.prompt_tokens)
        self.tokens.labels(model, engine, "completion").inc(stats.completion_tokens)
        self.cached_tokens.labels(model, engine).inc(stats.cached_tokens)
        self.queue_time.labels(model, engine).observe(stats.queue_s)
        if stats.completion_tokens:
            self.ttft.labels(model, engine).observe(stats.ttft_s)
        if stats.decode_tokens_per_s > 0:
            self.decode_speed.labels(model, engine).observe(stats.decode_tokens_per_s)
        self.peak_memory.labels(model, engine).set(stats.peak_memory_bytes)
        self.kv_cache.labels(model, engine).set(stats.kv_cache_bytes)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveCollector:
    """What is read at scrape time rather than counted: queue depth and process memory."""

    def __init__(self, model_registry):
        self.model_registry = model_registry
        self.process = psutil.Process()

    def collect(self):
        depth = GaugeMetricFamily(
            "duet_engine_queue_depth",
            "Requests admitted to an engine and not finished, the running one included",
            labels=["model", "engine"],
        )
        jobs = GaugeMetricFamily(
            "duet_engine_jobs", "Units of work admitted to an engine and not finished on its "
            "thread (generations, classifications, bench runs), by state",
            labels=["model", "engine", "state"],
        )
        batch = GaugeMetricFamily(
            "duet_engine_batch_size", "Sequences in the engine's latest step",
            labels=["model", "engine"])
        kv_used = GaugeMetricFamily(
            "duet_engine_kv_cache_used_bytes", "KV cache bytes held by running sequences",
            labels=["model", "engine"])
        kv_size = GaugeMetricFamily(
            "duet_engine_kv_cache_bytes", "Size of the engine's KV cache",
            labels=["model", "engine"])
        prefix = GaugeMetricFamily(
            "duet_engine_prefix_cache_tokens", "Tokens of KV kept in the prefix cache (held by "
            "running sequences or evictable)", labels=["model", "engine"])
        gc_pause = CounterMetricFamily(
            "duet_engine_gc_pause_seconds", "Time the process an engine's steps run in spent in "
            "Python's garbage collections (each stops its Python threads)",
            labels=["model", "engine"])
        gc_oldest = CounterMetricFamily(
            "duet_engine_gc_oldest_collections", "Collections of the oldest generation (the long "
            "ones) in the process an engine's steps run in", labels=["model", "engine"])
        ranks = GaugeMetricFamily(
            "duet_engine_rank_memory_bytes", "A tensor-parallel engine's memory on each rank's "
            "device (CUDA allocator; process RSS on the CPU), as the rank last reported",
            labels=["model", "engine", "rank"])
        for model, engine, worker in self.model_registry.loaded_workers():
            depth.add_metric([model, engine], worker.pending)
            status = worker.status()
            jobs.add_metric([model, engine, "running"], status.running)
            jobs.add_metric([model, engine, "waiting"], status.waiting)
            runtime = worker.runtime_status()
            if runtime is not None:
                batch.add_metric([model, engine], runtime["batch"])
                kv_used.add_metric([model, engine], runtime["kv_cache_used_bytes"])
                kv_size.add_metric([model, engine], runtime["kv_cache_bytes"])
                prefix.add_metric([model, engine], runtime["prefix_cache_tokens"])
                gc_pause.add_metric([model, engine], runtime["gc_pause_ms"] / 1000)
                gc_oldest.add_metric([model, engine], runtime["gc_oldest_collections"])
                for rank in runtime.get("ranks", ()):
                    ranks.add_metric([model, engine, str(rank["rank"])], rank["memory_bytes"])
        yield from (depth, jobs, batch, kv_used, kv_size, prefix, gc_pause, gc_oldest, ranks)
        memory = self.process.memory_info()
        yield GaugeMetricFamily(
            "duet_process_resident_memory_bytes", "Resident memory of the server process",
            value=memory.rss,
        )
        yield GaugeMetricFamily(
            "duet_process_virtual_memory_bytes", "Virtual memory of the server process",
            value=memory.vms,
        )


class RequestMetricsMiddleware:
    """Counts every HTTP request by its route template, so that unknown paths cannot blow up
    the number of series (they count as 'unmatched')."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED
        started = time.perf_counter()

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        except Exception:
            status = "500"
            raise
        finally:
            endpoint = _endpoint(scope)
            self.metrics.requests.labels(endpoint, scope["method"], status).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)


def _endpoint(scope: Scope) -> str:
    """The route template of a request, also for one refused before routing (401, 413): then
    it is looked up among the paths of the app's OpenAPI schema."""
    route = scope.get("route")
    if getattr(route, "path", None):
        return route.path
    app = scope.get("app")
    if app is None:
        return "unmatched"
    templates = getattr(app.state, "path_templates", None)
    if templates is None:
        templates = [(compile_path(p)[0], p) for p in app.openapi().get("paths", {})]
        app.state.path_templates = templates
    return next((p for regex, p in templates if regex.match(scope["path"])), "unmatched")
