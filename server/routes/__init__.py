from fastapi import APIRouter

from . import bench, chat, completions, health, models

router = APIRouter()
for module in (health, models, chat, completions, bench):
    router.include_router(module.router)
