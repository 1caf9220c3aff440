"""A tiny random BERT sentence-embedding model, written the way sentence-transformers writes
real ones (config.json, model.safetensors, a WordPiece tokenizer, modules.json, 1_Pooling,
sentence_bert_config.json), with transformers' BertModel as its reference."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world",
         "cat", "sat", "on", "mat", "##s", "##ing", "##ed"]
SYMBOLS = list(string.ascii_lowercase + string.digits + ".,!?'-")
VOCAB = SPECIALS + WORDS + SYMBOLS + ["##" + c for c in string.ascii_lowercase + string.digits]
SPARE_ROWS = 7  # embedding rows past the tokenizer's, as real checkpoints have


def _tokenizer(max_tokens: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_tokens,
    )


def make_tiny_bert(path: Path, *, pooling: str = "mean", normalize: bool = True,
                   max_seq_length: int = 24, hidden_act: str = "gelu", seed: int = 0):
    """Write the model to path; returns the reference BertModel (float32, eval mode).

    Every weight is random, the LayerNorms' too (so that a swapped or missing one shows)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(VOCAB) + SPARE_ROWS, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
        type_vocab_size=2, hidden_act=hidden_act, layer_norm_eps=1e-12, pad_token_id=0,
    )
    model = BertModel(config, add_pooling_layer=True).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(max_seq_length).save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    }))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    return model


def reference_embeddings(model, path: Path, texts: list[str], *, pooling: str = "mean",
                         normalize: bool = True, max_seq_length: int = 24):
    """transformers' BertModel over the model's own tokenizer, then mean (or CLS) pooling
    and normalisation: float32 numpy [texts, hidden]."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    enc = tok(texts, padding=True, truncation=True, max_length=max_seq_length,
              return_tensors="pt")
    with torch.no_grad():
        states = model(**enc).last_hidden_state
    if pooling == "cls":
        vectors = states[:, 0]
    else:
        mask = enc["attention_mask"].unsqueeze(-1).float()
        vectors = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    return vectors.numpy()
