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
    tokenize,
)

router = APIRouter()
for module in (health, metrics, models, chat, completions, classifications, embeddings, bench,
               tokenize):
    router.include_router(module.router)
