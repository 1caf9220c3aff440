"""Load Hugging Face safetensors (or random weights of a shape) into duet's Transformer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..base import UnsupportedModel
from ..models.dummy import is_dummy
from .config import ModelArgs
from .model import Transformer
from .tensor_parallel import Shard, read_shard, split_modules

# Hugging Face keeps these projections apart; duet multiplies by each group as one matrix.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def refuse_quantized_checkpoint(cfg: dict, model_dir: Path) -> None:
    """Weights quantized on disk in another library's layout (mlx-lm's, or GPTQ/AWQ/bitsandbytes
    in Hugging Face's quantization_config) have no loader here: say so before reading them."""
    if "quantization" in cfg:
        bits = cfg["quantization"].get("bits", "?") if isinstance(cfg["quantization"], dict) else "?"
        raise UnsupportedModel(
            f"{model_dir.name} is an MLX {bits}-bit checkpoint: serve it on the mlx engine, or "
            f"give the torch engine its float weights with quantize = \"int4\" or \"int8\"")
    if "quantization_config" in cfg:
        method = cfg["quantization_config"].get("quant_method", "quantized") \
            if isinstance(cfg["quantization_config"], dict) else "quantized"
        raise UnsupportedModel(
            f"{model_dir.name} is a {method} checkpoint, which the torch engine cannot load: "
            f"give it the float weights with quantize = \"int4\", \"int8\" or \"fp8\"")


def _safetensor_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"no *.safetensors files in {model_dir}")
    return files


def _read_hf_state(model_dir: Path, tie: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _safetensor_files(model_dir):
        for name, tensor in load_file(str(path), device="cpu").items():
            if not (tie and name == "lm_head.weight"):
                state[name] = tensor
    return state


def _fuse(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


def _meta_model(args: ModelArgs, shard: Shard | None, group) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    if shard is not None:
        split_modules(model, shard, group)
    return model


def load_model(model_dir: Path, dtype: torch.dtype, device: str, shard: Shard | None = None,
               group=None) -> Transformer:
    """The model, or with shard its share for one rank of a tensor-parallel group that sums
    over group (tensor_parallel.py)."""
    cfg = read_config(model_dir)
    refuse_quantized_checkpoint(cfg, model_dir)
    args = ModelArgs.from_hf(cfg)
    if is_dummy(cfg):
        return random_model(args, dtype, device, shard=shard, group=group)
    model = _meta_model(args, shard, group)
    tie = args.tie_word_embeddings
    state = _read_hf_state(model_dir, tie) if shard is None else \
        read_shard(_safetensor_files(model_dir), args, shard, tie)
    state = _fuse(state, args.num_layers)
    expected = set(model.state_dict())
    if args.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - state.keys()
    if missing:
        raise UnsupportedModel(f"{model_dir}: weights missing: {sorted(missing)[:5]}")
    state = {k: state[k].to(device=device, dtype=dtype) for k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def random_model(args: ModelArgs, dtype: torch.dtype, device: str, seed: int = 0,
                 shard: Shard | None = None, group=None) -> Transformer:
    """Weights of the right shapes drawn at random on the device (vLLM's --load-format dummy):
    decode speed does not depend on weight values. A rank draws its share alone, so a model
    no one device holds never exists whole."""
    model = _meta_model(args, shard, group)
    model = model.to(dtype).to_empty(device=device)  # never whole in float32 first
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:  # a seed per tensor: the ranks' whole tensors (embeddings) come out equal
                p.normal_(0.0, 0.02, generator=generator.manual_seed(seed + i))
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
