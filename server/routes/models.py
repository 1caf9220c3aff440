from fastapi import APIRouter, Request

router = APIRouter()


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
        }
        worker = registry.loaded_worker(spec.id, name)
        if worker is not None:
            status = worker.status()
            card.update(running=status.running, waiting=status.waiting,
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
