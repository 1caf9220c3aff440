from fastapi import APIRouter, Request

from ..responses import create_response, not_stored
from ..responses_protocol import ResponsesRequest

router = APIRouter()


@router.post("/v1/responses", tags=["generation"])
async def create(body: ResponsesRequest, request: Request):
    return await create_response(request.app.state.service, body)


# duet keeps no responses: what would read, cancel or delete a stored one says so. Left out
# of the OpenAPI schema: they serve nothing.
@router.get("/v1/responses/{response_id}", include_in_schema=False)
@router.delete("/v1/responses/{response_id}", include_in_schema=False)
@router.get("/v1/responses/{response_id}/input_items", include_in_schema=False)
@router.post("/v1/responses/{response_id}/cancel", include_in_schema=False)
async def stored(response_id: str):
    raise not_stored(response_id)
