from fastapi import APIRouter

from . import chat, completions, health, models

router = APIRouter()
for module in (health, models, chat, completions):
    router.include_router(module.router)
