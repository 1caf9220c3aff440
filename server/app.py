"""create_app(settings): the one way to build duet's FastAPI application."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.middleware.cors import CORSMiddleware

from engines import gc_pauses
from engines.models.config import load_models_file
from engines.runtime.sizing import RuntimeOptions

from .auth import APIKeyMiddleware
from .bench import STATIC_DIR, BenchService
from .bench_gate import BenchLoadGate, LoadGate
from .classify_service import ClassificationService
from .embed_service import EmbeddingService
from .errors import install_error_handlers
from .metrics import RequestMetricsMiddleware, ServerMetrics
from .registry import (
    BackendEngineFactory,
    EngineFactory,
    ModelRegistry,
    ProcessPolicy,
    default_model_id,
)
from .request_guard import RequestGuard, ShutdownNotice
from .routes import router
from .service import GenerationService
from .settings import Settings
from .tokenizer_service import TokenizerService

log = logging.getLogger("duet.server")


def create_app(settings: Settings | None = None, factory: EngineFactory | None = None) -> FastAPI:
    settings = settings or Settings()
    specs = load_models_file(settings.models_file)  # a bad registry stops start-up here
    api_keys = settings.accepted_api_keys()  # so does an unreadable key file
    startup_model = default_model_id(specs, settings.model)
    override = {startup_model: settings.engine} if settings.engine else {}
    if factory is None:
        factory = BackendEngineFactory(
            RuntimeOptions(kv_cache_memory=settings.kv_cache_memory,
                           max_batch=settings.max_batch,
                           max_prefill_tokens=settings.max_prefill_tokens,
                           prefix_cache=settings.prefix_cache),
            device=settings.device, compile=settings.compile,
            mps_memory_fraction=settings.mps_memory_fraction,
            tensor_parallel=settings.tensor_parallel,
        )
    registry = ModelRegistry(
        specs, factory, override,
        max_queue=settings.max_queue, request_timeout_s=settings.request_timeout_s,
        engine_process=ProcessPolicy(settings.engine_process, settings.device,
                                     settings.tensor_parallel),
        keep_alive=settings.keep_alive, max_loaded=settings.max_loaded_models,
        memory_budget=settings.memory_budget,
    )
    metrics = ServerMetrics(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gc_pauses.watch()  # a long collection here stalls every stream: it is logged
        if settings.preload:
            engine = registry.default_engine(startup_model)
            log.info("loading %s on the %s engine", startup_model, engine)
            with gc_pauses.held():  # the load's imports, then settled below
                await registry.worker(startup_model, engine)
        # What the server imported and loaded lives as long as it does: kept out of the
        # collections that would otherwise walk it, stalling every stream (gc_pauses.py).
        gc_pauses.settle("the server started", None)
        reaper = asyncio.create_task(registry.reap_forever())
        yield
        reaper.cancel()
        await registry.aclose()

    app = FastAPI(title="duet", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.service = GenerationService(registry, observer=metrics)
    app.state.classifier = ClassificationService(registry, settings)
    app.state.embedder = EmbeddingService(registry, settings)
    app.state.tokenizers = TokenizerService(registry, startup_model)
    app.state.startup_model = startup_model
    app.state.started = int(time.time())
    app.state.bench_gate = LoadGate()
    app.state.bench = BenchService(registry, settings, startup_model, app.state.bench_gate)
    app.state.shutdown = ShutdownNotice()  # expired by run_server when the grace period ends
    install_error_handlers(app)
    app.include_router(router)
    if settings.bench_enabled:
        # The /bench page's script and styles ship inside the package: no CDN.
        app.mount("/bench/assets", StaticFiles(directory=STATIC_DIR), name="bench-assets")
    # The last added runs first: CORS answers preflights before the key is asked for, every
    # request is counted (a 401 too), and only a caller with the key gets its body read.
    app.add_middleware(BenchLoadGate, gate=app.state.bench_gate)
    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s, shutdown=app.state.shutdown)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
