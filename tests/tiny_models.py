"""Tiny random-weight checkpoints of each supported family, written the way transformers
writes real ones, with a byte-level tokenizer and a chat template."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


VOCAB = 3 + 256 + 5  # specials, bytes, a few spare rows as real checkpoints have

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


def family_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama3":
        return LlamaConfig(
            **COMMON, tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            }, rope_theta=500000.0,
        )
    if family == "smollm":  # SmolLM is a Llama with tied embeddings and a large rope theta
        return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=100000.0)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=None, head_dim=16, tie_word_embeddings=False)
    if family == "mistral_window":  # a window shorter than the test prompts: the mask matters
        return MistralConfig(**COMMON, sliding_window=4, head_dim=16, tie_word_embeddings=False)
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False)
    raise ValueError(family)


FAMILIES = ("llama", "llama3", "smollm", "mistral", "mistral_window", "qwen2")


def make_tiny_model(out_dir: Path, family: str = "llama", seed: int = 0):
    """Save a random model and tokenizer to out_dir; return the transformers model (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # random init is tiny; widen it so logits differ visibly
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # biases (Qwen2's q/k/v) start at zero; make them count
                p.normal_(0, 0.05)
    model = model.float().eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    _byte_tokenizer().save_pretrained(out_dir)
    return model


def load_tiny_model(path: Path):
    """The transformers reference of a model make_tiny_model saved (the same fp32 weights),
    from the pickle it left beside the checkpoint: much faster than from_pretrained."""
    import torch

    return torch.load(path / "reference.pt", weights_only=False)
