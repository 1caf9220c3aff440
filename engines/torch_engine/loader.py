"""Load Hugging Face safetensors into duet's Transformer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..base import UnsupportedModel
from .config import ModelArgs
from .model import Transformer


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _safetensor_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"no *.safetensors files in {model_dir}")
    return files


def load_model(model_dir: Path, dtype: torch.dtype, device: str) -> Transformer:
    from safetensors.torch import load_file

    args = ModelArgs.from_hf(read_config(model_dir))
    with torch.device("meta"):
        model = Transformer(args)
    state: dict[str, torch.Tensor] = {}
    for path in _safetensor_files(model_dir):
        for name, tensor in load_file(str(path), device="cpu").items():
            if args.tie_word_embeddings and name == "lm_head.weight":
                continue
            state[name] = tensor.to(device=device, dtype=dtype)
    expected = set(model.state_dict())
    if args.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - state.keys()
    if missing:
        raise UnsupportedModel(f"{model_dir}: weights missing: {sorted(missing)[:5]}")
    state = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
