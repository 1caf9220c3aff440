from fastapi import APIRouter

from . import bench, chat, completions, health, metrics, models

router = APIRouter()
for module in (health, metrics, models, chat, completions, bench):
    router.include_router(module.router)
