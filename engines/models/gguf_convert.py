"""Convert a Llama-family GGUF file into a Hugging Face-style model directory.

Both engines load safetensors directories, so a GGUF model is written once as safetensors plus
config, tokenizer and chat template, each tensor at its own precision: float32 and float16
tensors as they are, quantized ones (Q4_0, Q4_1, Q8_0, the K quants...) dequantized to float16,
whose 11-bit significand holds a 4-bit value times a float16 scale to within a rounding, at half
float32's bytes (an 8B model in 16 GB, not 32). bfloat16 tensors, which numpy cannot write, are
kept in float32. The directory appears atomically: it is
written under a temporary name and renamed only when complete, so an interrupted conversion
never leaves a directory that a later start would trust.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..quantization import SOURCE_KEY
from .atomic_dir import build_atomically

COMPLETE_MARKER = "duet-complete.json"
CONVERTER_VERSION = 3  # 1 wrote every tensor in float32; 2 did not record the source's type

# llama.cpp's tensor names -> Hugging Face's, per block and global.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor '{gguf_name}' in GGUF file")


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp interleaves the rotary halves of Q and K rows; undo it for HF's rotate_half."""
    head_dim = weight.shape[0] // n_heads // 2
    w = weight.reshape(n_heads, head_dim, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture '{arch}' is not supported (only 'llama')")
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(
            _field(reader, p + "vocab_size", len(_field(reader, "tokenizer.ggml.tokens", [])))
        ),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float16",
        **({SOURCE_KEY: quant} if (quant := source_quantization(reader)) else {}),
    }


def source_quantization(reader) -> str | None:
    """The quantized type most of the blocks' matrices are stored in (a "Q4_1" file keeps its
    embedding in Q8_0 and its norms in F32): what the engines serve it in by default."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if t.name.startswith("blk.") and len(t.shape) == 2 and kind not in _FLOAT_TYPES:
            counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def _convert_weights(reader, config: dict, out_dir: Path, progress, float32: bool) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for t in progress(reader.tensors):
        name = hf_tensor_name(t.name)
        array = np.ascontiguousarray(dequantize(t.data, t.tensor_type),
                                     dtype=stored_dtype(t.tensor_type.name, float32))
        if name.endswith("q_proj.weight"):
            array = unpermute_rotary(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute_rotary(array, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(array)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def stored_dtype(gguf_type: str, float32: bool = False) -> type:
    """The numpy dtype a GGUF tensor of this type is written in (float32: every one asked
    for in float32)."""
    return np.float32 if float32 or gguf_type in ("F32", "F64", "BF16") else np.float16


_FLOAT_TYPES = ("F32", "F64", "F16", "BF16")


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: Path, target: Path, show_progress: bool = True, *,
                 float32: bool = False) -> Path:
    """Convert once; return the finished directory (an existing complete one is reused).
    float32: every tensor dequantized to float32 instead of quantized ones to float16."""

    def build(tmp: Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
        config = gguf_config(reader)
        with _progress(show_progress, f"converting {gguf_path.name}") as progress:
            _convert_weights(reader, config, tmp, progress, float32)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _convert_tokenizer(gguf_path, tmp)
        (tmp / COMPLETE_MARKER).write_text(
            json.dumps({"source": str(gguf_path), "converter_version": CONVERTER_VERSION})
        )

    return build_atomically(target, build, is_complete)


class _progress:
    """A rich progress bar over the tensors, or a silent pass-through."""

    def __init__(self, enabled: bool, label: str):
        self._enabled = enabled
        self._label = label
        self._bar = None

    def __enter__(self):
        if not self._enabled:
            return lambda items: items
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=False,
        )
        self._bar.__enter__()

        def track(items):
            return self._bar.track(items, total=len(items), description=self._label)

        return track

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False
