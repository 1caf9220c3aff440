from fastapi import APIRouter, Request, Response

router = APIRouter()


@router.get("/metrics", tags=["server"], response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text format; needs the API key when keys are set, like everything but /health."""
    body, content_type = request.app.state.metrics.exposition()
    return Response(body, media_type=content_type)
