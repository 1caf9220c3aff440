from fastapi import APIRouter

from . import bench, chat, classifications, completions, health, metrics, models, tokenize

router = APIRouter()
for module in (health, metrics, models, chat, completions, classifications, bench, tokenize):
    router.include_router(module.router)
