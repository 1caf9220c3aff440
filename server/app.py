"""create_app(settings): the one way to build duet's FastAPI application."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engines.config import load_models_file

from .classify_service import ClassificationService
from .errors import install_error_handlers
from .registry import BackendEngineFactory, EngineFactory, ModelRegistry, default_model_id
from .routes import router
from .service import GenerationService
from .settings import Settings

log = logging.getLogger("duet.server")


def create_app(settings: Settings | None = None, factory: EngineFactory | None = None) -> FastAPI:
    settings = settings or Settings()
    specs = load_models_file(settings.models_file)  # a bad registry stops start-up here
    startup_model = default_model_id(specs, settings.model)
    override = {startup_model: settings.engine} if settings.engine else {}
    if factory is None:
        factory = BackendEngineFactory(
            device=settings.device, compile=settings.compile,
            mps_memory_fraction=settings.mps_memory_fraction,
        )
    registry = ModelRegistry(specs, factory, override)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.preload:
            engine = registry.default_engine(startup_model)
            log.info("loading %s on the %s engine", startup_model, engine)
            await registry.worker(startup_model, engine)
        yield
        registry.close()

    app = FastAPI(title="duet", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.registry = registry
    app.state.service = GenerationService(registry)
    app.state.classifier = ClassificationService(registry, settings)
    app.state.startup_model = startup_model
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.include_router(router)
    return app
