from fastapi import APIRouter, Request

from ..protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize", tags=["tokenizer"])
async def tokenize(body: TokenizeRequest, request: Request):
    return await request.app.state.tokenizers.tokenize(body)


@router.post("/detokenize", tags=["tokenizer"])
async def detokenize(body: DetokenizeRequest, request: Request):
    return await request.app.state.tokenizers.detokenize(body)


@router.get("/tokenizer_info", tags=["tokenizer"])
async def tokenizer_info(request: Request, model: str | None = None):
    return await request.app.state.tokenizers.info(model)
