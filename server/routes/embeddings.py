from fastapi import APIRouter, Request

from ..embed_protocol import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings", tags=["embeddings"])
async def embeddings(body: EmbeddingRequest, request: Request):
    return await request.app.state.embedder.embed(body)
