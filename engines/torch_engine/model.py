"""duet's own Llama-family transformer, in the manner of gpt-fast.

The KV cache is preallocated for the whole context and written in place; attention goes through
scaled_dot_product_attention; prefill and the single-token decode step are separate calls so a
compiler can wrap the decode step with static shapes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base import UnsupportedModel
from .config import ModelArgs


class KVCache(nn.Module):
    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (1, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update_and_fetch(self, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = args.rope_scaling
    if not s:
        return inv.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv / s["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        orig = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / lo, inv / factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        return torch.where(medium, smoothed, scaled).float()
    raise UnsupportedModel(f"rope scaling '{kind}' is not supported (default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        d = args.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=args.o_bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, start: int, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = self.kv_cache.update_and_fetch(start, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and t > 1, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(d, h, bias=bias)
        self.up_proj = nn.Linear(d, h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """Parameter names match Hugging Face's *ForCausalLM, so safetensors load as they are."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_len = 0

    def setup_cache(self, max_len: int) -> None:
        """Allocate the KV cache and rotary tables once, for the whole context."""
        p = self.model.embed_tokens.weight
        a = self.args
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(max_len, a.num_kv_heads, a.head_dim, p.dtype, p.device)
        inv = rope_inv_freq(a).to(p.device)
        freqs = torch.outer(torch.arange(max_len, device=p.device, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(p.dtype), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(p.dtype), persistent=False)
        self.max_len = max_len

    @property
    def kv_cache_bytes(self) -> int:
        return sum(layer.self_attn.kv_cache.nbytes for layer in self.model.layers)

    def _mask(self, start: int, t: int, device) -> torch.Tensor | None:
        window = self.args.sliding_window
        end = start + t
        needs_window = window is not None and end > window
        if start == 0 and not needs_window:
            return None  # plain causal (or a single token seeing everything)
        if t == 1 and not needs_window:
            return None
        q_pos = torch.arange(start, end, device=device)[:, None]
        k_pos = torch.arange(end, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask

    def forward(self, tokens: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits for `tokens` [1, T] at positions start..start+T (only the last if last_only)."""
        t = tokens.shape[1]
        if start + t > self.max_len:
            raise ValueError(f"position {start + t} is past the KV cache ({self.max_len})")
        cos = self.rope_cos[start : start + t]
        sin = self.rope_sin[start : start + t]
        mask = self._mask(start, t, tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, start, mask)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))
