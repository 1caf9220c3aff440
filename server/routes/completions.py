from fastapi import APIRouter, Request

from ..protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions", tags=["generation"])
async def completions(body: CompletionRequest, request: Request):
    return await request.app.state.service.completion(body)
