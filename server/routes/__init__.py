from fastapi import APIRouter

from . import chat, classifications, completions, health, models

router = APIRouter()
for module in (health, models, chat, completions, classifications):
    router.include_router(module.router)
