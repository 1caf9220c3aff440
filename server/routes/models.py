import time

from fastapi import APIRouter, Request
from pydantic import Field

from ..protocol import EngineChoice, KeepAlive, Strict, Text

router = APIRouter()


class LoadRequest(Strict):
    model: Text = Field(min_length=1, max_length=256)
    engine: EngineChoice | None = None
    keep_alive: KeepAlive | None = Field(
        None, description="how long it stays loaded (default: the model's, else the server's)")


class UnloadRequest(Strict):
    model: Text = Field(min_length=1, max_length=256)
    engine: EngineChoice | None = Field(None, description="default: every engine of the model")


def _model_card(registry, spec, created: int) -> dict:
    engines = []
    for name in registry.factory.names:
        info = registry.loaded_info(spec.id, name)
        card = {
            "name": name,
            "available": registry.factory.available(name),
            "loaded": info is not None,
            "device": info.device if info else None,
            "dtype": info.dtype if info else None,
            "quantization": info.quantization if info else None,
            "weights_bytes": info.weights_bytes if info else None,
            "kv_cache_bytes": info.kv_cache_bytes if info else None,
        }
        worker = registry.loaded_worker(spec.id, name)
        if worker is not None:
            status = worker.status()
            card.update(running=status.running, waiting=status.waiting,
                        **registry.residency_of(spec.id, name),
                        **(worker.runtime_status() or {}))
        engines.append(card)
    return {
        "id": spec.id, "object": "model", "created": created, "owned_by": "duet",
        "task": spec.task, "context_length": spec.context_length, "quantize": spec.quantize,
        "default_engine": registry.default_engine(spec.id), "engines": engines,
    }


@router.get("/v1/models", tags=["models"])
async def list_models(request: Request) -> dict:
    state = request.app.state
    return {
        "object": "list",
        "data": [_model_card(state.registry, s, state.started) for s in state.registry.specs.values()],
    }


@router.get("/v1/models/{model_id:path}", tags=["models"])
async def get_model(model_id: str, request: Request) -> dict:
    state = request.app.state
    return _model_card(state.registry, state.registry.spec(model_id), state.started)


@router.post("/models/load", tags=["models"])
async def load_model(body: LoadRequest, request: Request) -> dict:
    """Load a model on an engine now (as its first request would), and set its keep_alive."""
    registry = request.app.state.registry
    started = time.perf_counter()
    worker = await registry.worker(body.model, body.engine, body.keep_alive)
    info = worker.engine.info
    return {"model": registry.spec(body.model).id, "engine": info.engine, "loaded": True,
            "seconds": round(time.perf_counter() - started, 3),
            **registry.residency_of(body.model, info.engine)}


@router.post("/models/unload", tags=["models"])
async def unload_model(body: UnloadRequest, request: Request) -> dict:
    """Unload a model's engines once the requests they are serving are done."""
    registry = request.app.state.registry
    engine = None if body.engine in (None, "auto") else body.engine
    return {"model": registry.spec(body.model).id,
            "unloaded": await registry.unload(body.model, engine)}
