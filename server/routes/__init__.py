from fastapi import APIRouter

from . import chat, completions, health, metrics, models

router = APIRouter()
for module in (health, metrics, models, chat, completions):
    router.include_router(module.router)
