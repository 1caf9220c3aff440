from fastapi import APIRouter

from . import bench, chat, classifications, completions, health, metrics, models

router = APIRouter()
for module in (health, metrics, models, chat, completions, classifications, bench):
    router.include_router(module.router)
