from fastapi import APIRouter, Request

from ..protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", tags=["generation"])
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await request.app.state.service.chat(body)
