from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from ..bench import STATIC_DIR, BenchRequest, bench_disabled, respond

router = APIRouter()
PAGE = STATIC_DIR / "bench.html"


@router.post("/bench", tags=["bench"])
async def run_bench(body: BenchRequest, request: Request):
    return await respond(request.app.state.bench, body, request)


@router.get("/bench", tags=["bench"], include_in_schema=False)
async def bench_page(request: Request):
    if not request.app.state.settings.bench_enabled:
        raise bench_disabled()
    return FileResponse(PAGE, media_type="text/html")
