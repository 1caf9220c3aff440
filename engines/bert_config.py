"""A BERT encoder's shape (config.json) and the names of its weights, shared by the torch and
MLX encoders (engines/torch_engine/bert.py, engines/mlx_engine/bert.py).

Both encoders name their parameters the same short way; duet_name() maps a checkpoint's
Hugging Face names (BertModel's, or a task model's with the 'bert.' prefix) onto them and
drops the tensors an encoder does not use (the pooler, a task head, position_ids)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .base import UnsupportedModel

# Hidden activations and whether each is the tanh approximation of GELU.
ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


@dataclass(frozen=True)
class BertShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    tanh_gelu: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def read_bert_shape(model_dir: Path) -> BertShape:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    kind = cfg.get("model_type")
    if kind != "bert":
        raise UnsupportedModel(f"an embed model must be a BERT encoder (model_type 'bert'); "
                               f"this one is '{kind}'")
    position = cfg.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise UnsupportedModel(f"position_embedding_type '{position}' is not supported "
                               "(only 'absolute')")
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"hidden_act '{act}' is not supported (one of "
                               f"{', '.join(ACTIVATIONS)})")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if hidden % heads:
        raise UnsupportedModel(f"hidden_size {hidden} is not a multiple of the {heads} heads")
    return BertShape(
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        intermediate_size=int(cfg["intermediate_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 512)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        pad_token_id=int(cfg.get("pad_token_id") or 0),
        tanh_gelu=ACTIVATIONS[act],
    )


_GLOBAL = {
    "embeddings.word_embeddings": "embeddings.word",
    "embeddings.position_embeddings": "embeddings.position",
    "embeddings.token_type_embeddings": "embeddings.token_type",
    "embeddings.LayerNorm": "embeddings.norm",
}
_LAYER = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_OLD_NORM = {"gamma": "weight", "beta": "bias"}  # LayerNorm names of old TF-era checkpoints


def duet_name(hf_name: str) -> str | None:
    """'encoder.layer.3.attention.self.query.weight' -> 'layers.3.query.weight'; None for a
    tensor the encoder does not use."""
    name = hf_name.removeprefix("bert.")
    module, _, leaf = name.rpartition(".")
    leaf = _OLD_NORM.get(leaf, leaf)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    match = _LAYER_NAME.match(module)
    if match and match.group(2) in _LAYER:
        return f"layers.{match.group(1)}.{_LAYER[match.group(2)]}.{leaf}"
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards), else pytorch_model.bin."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("model*.safetensors"))
    if files:
        return files
    legacy = model_dir / "pytorch_model.bin"
    if legacy.is_file():
        return [legacy]
    raise UnsupportedModel(f"{model_dir} has no model.safetensors (nor pytorch_model.bin)")
