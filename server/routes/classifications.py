from fastapi import APIRouter, Request

from ..classify_protocol import ClassificationRequest

router = APIRouter()


@router.post("/v1/classifications", tags=["classification"])
async def classifications(body: ClassificationRequest, request: Request):
    return await request.app.state.classifier.classify(body)
