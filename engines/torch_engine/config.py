"""The Llama-family shape, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import UnsupportedModel
from ..models.model_config import attention_window

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedModel(
                f"model type '{model_type}' is not supported by the torch engine "
                f"(supported: {', '.join(SUPPORTED_TYPES)}, which covers Llama, Mistral, "
                f"Qwen2 and SmolLM)"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"activation '{act}' is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope settings into rope_parameters; older files use the top level.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=attention_window(cfg),
        )
