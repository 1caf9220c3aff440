"""Facts read from a checkpoint's config.json that both engines must agree on."""

from __future__ import annotations


def attention_window(cfg: dict) -> int | None:
    """The sliding attention window, if the model uses one: Mistral's `sliding_window`, and
    Qwen2's only when `use_sliding_window` is set (its files carry a window either way)."""
    model_type = cfg.get("model_type")
    if model_type == "qwen2":
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    elif model_type == "mistral":
        window = cfg.get("sliding_window")
    else:
        window = None
    return int(window) if window else None
