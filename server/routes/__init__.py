from fastapi import APIRouter

from . import (
    bench,
    chat,
    classifications,
    completions,
    embeddings,
    health,
    metrics,
    models,
    responses,
    tokenize,
)

router = APIRouter()
for module in (health, metrics, models, chat, completions, responses, classifications,
               embeddings, bench, tokenize):
    router.include_router(module.router)
