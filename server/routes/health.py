from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/health", tags=["server"])
async def health(request: Request) -> dict:
    registry = request.app.state.registry
    loaded = [
        {"model": model_id, "engine": engine}
        for model_id in registry.specs
        for engine in registry.factory.names
        if registry.is_loaded(model_id, engine)
    ]
    return {"status": "ok", "loaded": loaded}
