"""Random-weight models of real shapes, for benchmarks where weights cannot be fetched (as
vLLM's --load-format dummy): decode speed depends on shapes, not on weight values.

A dummy model directory holds a real config.json, flagged so the engines draw random weights,
and a word-level tokenizer with the full vocabulary, so detokenizing costs what it would."""

from __future__ import annotations

import json
from pathlib import Path

from .atomic_dir import build_atomically

DUMMY_FLAG = "duet_dummy_weights"

_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    # 141 GB of weights in bf16: more than one GPU holds; for tensor parallelism's benchmarks.
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        use_sliding_window=False,
    ),
}


def _config(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown dummy shape '{shape}' (known: {', '.join(SHAPES)})")
    return {
        **SHAPES[shape], "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16", DUMMY_FLAG: True,
    }


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    return fast


def write_dummy_model(shape: str, target: Path) -> Path:
    """Write (once, atomically) the directory of a dummy model of `shape`."""
    config = _config(shape)

    def build(tmp: Path) -> None:
        _tokenizer(config["vocab_size"]).save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return build_atomically(target, build, lambda d: (d / "config.json").is_file())


def is_dummy(config: dict) -> bool:
    return bool(config.get(DUMMY_FLAG))
