import datetime as dt
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


def engine_state(model: str, engine: str, worker, stuck_grace_s: float, registry) -> dict:
    status = worker.status()
    state = {"model": model, "engine": engine, "state": "idle", "busy_since": None,
             "busy_s": None, "running": status.running, "waiting": status.waiting,
             "quantization": worker.engine.info.quantization,
             "weights_bytes": worker.engine.info.weights_bytes,
             **registry.residency_of(model, engine), **(worker.runtime_status() or {})}
    if status.busy_since is not None:
        state.update(
            state="stuck" if status.overdue_s > stuck_grace_s else "busy",
            busy_since=dt.datetime.fromtimestamp(status.busy_since, dt.timezone.utc)
            .isoformat(timespec="seconds"),
            busy_s=round(time.time() - status.busy_since, 3),
        )
    return state


def memory(registry) -> dict:
    """The memory budget and what each loaded engine holds of it (weights and KV cache)."""
    held = {f"{m}/{e}": w.engine.info.weights_bytes + w.engine.info.kv_cache_bytes
            for m, e, w in registry.loaded_workers() if w.engine is not None}
    return {"budget_bytes": registry.memory_budget, "held_bytes": sum(held.values()),
            "by_engine": held}


@router.get("/health", tags=["server"])
async def health(request: Request):
    """ok (200), or degraded (503, with a reason) while an engine is stuck: still running a
    unit of work more than stuck_grace_s past its time limit."""
    app = request.app
    grace = app.state.settings.stuck_grace_s
    registry = app.state.registry
    engines = [engine_state(m, e, w, grace, registry) for m, e, w in registry.loaded_workers()]
    body = {"status": "ok", "loaded": [{"model": s["model"], "engine": s["engine"]} for s in engines],
            "engines": engines, "memory": memory(registry)}
    stuck = [s for s in engines if s["state"] == "stuck"]
    if not stuck:
        return body
    limit = app.state.settings.request_timeout_s
    body["status"] = "degraded"
    body["reason"] = "; ".join(
        f"the {s['engine']} engine of {s['model']} has been running one unit of work for "
        f"{s['busy_s']:.0f} s, past the {limit:g} s time limit" for s in stuck)
    return JSONResponse(body, status_code=503)
