"""duet's own Llama-family transformer, in the manner of gpt-fast.

Attention goes through scaled_dot_product_attention (or, for a CUDA decode step, the Triton
kernel of decode_attention.py); Q/K/V and gate/up projections are fused into one matmul each.

Two ways to run it:
- forward_paged (the runtime's steps): a batch of rows, each at its own positions, writing its
  K/V into the runtime's paged pool (paged.py) and reading its pages back.
- forward (scoring, whole-prompt logits): one contiguous batch-1 cache that scratch_cache
  installs for the call; attention reads only its filled prefix.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..base import UnsupportedModel
from .config import ModelArgs
from .tensor_parallel import Sums, TokenShare, VocabSplit


class KVCache(nn.Module):
    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, dtype, device, batch: int = 1):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write_prefix(self, start: int, k: torch.Tensor, v: torch.Tensor):
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; it accumulates in float32 for half-precision inputs.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        d = args.hidden_size
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, d, bias=args.o_bias)
        self.kv_cache: KVCache | None = None
        self.window = args.sliding_window or 0
        # Set by the CUDA runner (Transformer.use_kernels): the static decode step calls the
        # Triton kernel in decode_attention.py instead of the PyTorch-op attention below, with
        # the counters it merges by (shared by the layers, whose kernels run one at a time).
        self.decode_kernel = False
        self.counters: torch.Tensor | None = None

    def forward(self, x, cos, sin, pos, mask, pool=None):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        if pool is not None and t == 1 and self.decode_kernel and pos.table is not None:
            return self.o_proj(self._decode_kernel(qkv, cos, sin, pos, pool).view(b, 1, -1))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Rotate Q and K together: half the small ops of rotating each.
        qk = apply_rope(qk.view(b, t, self.n_heads + self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if pool is not None:
            out = self._paged_attention(q, k, v, pos, pool)
        else:
            k, v = self.kv_cache.write_prefix(pos, k, v)
            if t == 1 and mask is None:
                out = self._one_query_attention(q, k, v)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                    enable_gqa=self.n_kv != self.n_heads,
                )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _decode_kernel(self, qkv, cos, sin, batch, pool):
        """A decode step's rows (one token each) through decode_attention.py's kernel, which
        rotates them, writes their K/V into the pool and attends: [B, H, D]."""
        k_pool, v_pool, _, _ = pool
        b = qkv.shape[0]
        return torch.ops.duet.paged_decode_attention(
            qkv.view(b, -1), cos.reshape(b, -1), sin.reshape(b, -1), k_pool, v_pool,
            batch.table, batch.positions[:, 0], batch.write_slots,
            self.counters if batch.counters is None else batch.counters, batch.kv_len,
            batch.page, self.window)

    def _paged_attention(self, q, k, v, batch, pool):
        """Write the rows' K/V into the pool, then attend over each row's keys: gathered from
        the pool, or the new keys alone when every row starts at 0."""
        k_pool, v_pool, read, mask = pool
        b, _, t, d = q.shape
        k_pool.index_copy_(0, batch.write_slots, k.transpose(1, 2).reshape(b * t, self.n_kv, d))
        v_pool.index_copy_(0, batch.write_slots, v.transpose(1, 2).reshape(b * t, self.n_kv, d))
        if read is not None:
            k = k_pool[read].transpose(1, 2)  # [B, KV, L, D]
            v = v_pool[read].transpose(1, 2)
        if mask is None:  # one fresh prompt: plain causal attention over its own keys
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1,
                                                  enable_gqa=self.n_kv != self.n_heads)
        # Fold each group's query heads into the query axis: the KV heads are read as they are
        # (the mask comes folded the same way, hidden_paged's once for every layer).
        q = q.reshape(b, self.n_kv, self.n_heads // self.n_kv * t, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.reshape(b, self.n_heads, t, d)

    def _one_query_attention(self, q, k, v):
        """Eager decode step: a group's query heads become the query axis of one K/V head, so
        SDPA reads the shared K/V as is (its enable_gqa path is several times slower on CPU)."""
        b, _, _, d = q.shape
        q = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, d)
        return F.scaled_dot_product_attention(q, k, v).reshape(b, self.n_heads, 1, d)

class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, self.hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_up_proj = nn.Linear(d, 2 * self.hidden, bias=bias)
        self.down_proj = nn.Linear(self.hidden, d, bias=bias)
        self.act_kernel = False  # set by the CUDA runner: silu_mul.py's Triton kernel

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        # The kernel is the decode step's (see silu_mul.py); a prefill's rows, run eagerly,
        # take the two plain ops, which cost the host less than a Triton launch does.
        if self.act_kernel and (x.shape[-2] == 1 or torch.compiler.is_compiling()):
            return self.down_proj(torch.ops.duet.silu_mul(gate_up))
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Under tensor parallelism (tensor_parallel.py) this rank holds some of the attention
        # heads and MLP units: their output projections' partial sums are added up over the
        # ranks, the attention's through phase 0, the MLP's through phase 1.
        self.sums: Sums | None = None

    def forward(self, x, cos, sin, pos, mask, pool=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, pos, mask, pool)
        x = x + (a if self.sums is None else self.sums(a, 0))
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (m if self.sums is None else self.sums(m, 1))

    def forward_normed(self, x, normed, next_norm: RMSNorm, cos, sin, pos, mask, pool=None):
        """forward under tensor parallelism with each sum, its residual add and the next norm
        in one (Sums.add_norm), given this block's input normed: (output, next_norm of it)."""
        a = self.self_attn(normed, cos, sin, pos, mask, pool)
        x, normed = self.sums.add_norm(a, x, self.post_attention_layernorm, 0)
        m = self.mlp(normed)
        return self.sums.add_norm(m, x, next_norm, 1)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """Parameter names follow Hugging Face's *ForCausalLM, with Q/K/V and gate/up fused."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_len = 0
        # Rank 0 of a tensor-parallel group: f(what, *args) tells the other ranks of each
        # forward outside the runtime's steps (scoring, whole-prompt logits), which they run
        # with it (ranks.py). Steps are told by the executor.
        self.mirror = None
        self.sums: Sums | None = None  # every layer's, under tensor parallelism
        self.vocab_split: VocabSplit | None = None  # the decode step's, under it
        self.token_share: TokenShare | None = None  # a pipelined step's tokens, under it

    def scratch_cache(self, max_len: int):
        """A contiguous batch-1 cache for max_len positions, for work outside the runtime's
        pool (scoring, whole-prompt logits), freed afterwards."""
        p = self.model.embed_tokens.weight
        return self._swapped_caches(
            lambda attn, _: KVCache(max_len, attn.n_kv, attn.head_dim, p.dtype, p.device),
            "scratch", max_len)

    def batched_caches(self, prompt_len: int, batch: int, extra: int):
        """Inside scratch_cache: swap every layer's cache for a batch of copies of its first
        prompt_len positions, with room for extra more (scoring continuations)."""

        def copies(_, cache: KVCache) -> KVCache:
            _, heads, _, dim = cache.k.shape
            out = KVCache(prompt_len + extra, heads, dim, cache.k.dtype, cache.k.device, batch)
            out.k[:, :, :prompt_len] = cache.k[:, :, :prompt_len]
            out.v[:, :, :prompt_len] = cache.v[:, :, :prompt_len]
            return out

        return self._swapped_caches(copies, "batched", prompt_len, batch, extra)

    @contextmanager
    def _swapped_caches(self, make, what: str, *args):
        """Every layer's cache replaced by make(attention, its cache) for the block, then put
        back; the other ranks of a tensor-parallel group are told what (and what_end)."""
        attns = [layer.self_attn for layer in self.model.layers]
        saved = [attn.kv_cache for attn in attns]
        if self.mirror is not None:
            self.mirror(what, *args)
        try:
            for attn, cache in zip(attns, saved):
                attn.kv_cache = make(attn, cache)
            yield
        finally:
            for attn, cache in zip(attns, saved):
                attn.kv_cache = cache
            if self.mirror is not None:
                self.mirror(f"{what}_end")

    def setup_cache(self, max_len: int) -> None:
        """Allocate the KV cache and rotary tables once, for the whole context."""
        p = self.model.embed_tokens.weight
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kv_cache = KVCache(max_len, attn.n_kv, attn.head_dim, p.dtype, p.device)
        self.setup_rope(max_len)

    def setup_rope(self, max_len: int) -> None:
        """The rotary tables for positions below max_len."""
        p = self.model.embed_tokens.weight
        inv = rope_inv_freq(self.args).to(p.device)
        freqs = torch.outer(torch.arange(max_len, device=p.device, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(p.dtype), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(p.dtype), persistent=False)
        self.max_len = max_len

    def forward_paged(self, batch, kv) -> torch.Tensor:
        """Logits [B, V] after each row's last real token, for a PagedBatch over the pool kv."""
        return self.head(self.last_hidden(batch, kv))

    def last_hidden(self, batch, kv) -> torch.Tensor:
        """The last layer's hidden states [B, H] at each row's last real token."""
        x = self.hidden_paged(batch, kv)
        return x[torch.arange(x.shape[0], device=x.device), batch.last]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states [..., H]."""
        return self.lm_head(self.model.norm(x))

    def hidden_paged(self, batch, kv) -> torch.Tensor:
        """The last layer's hidden states [B, T, H] (before the final norm) of a PagedBatch."""
        cos = self.rope_cos[batch.positions][:, None]  # [B, 1, T, D]
        sin = self.rope_sin[batch.positions][:, None]
        kernel = batch.tokens.shape[1] == 1 and batch.table is not None and \
            self.model.layers[0].self_attn.decode_kernel
        read, mask = (None, None) if kernel else batch.attend()  # once for every layer
        attn = self.model.layers[0].self_attn
        rep = attn.n_heads // attn.n_kv
        if mask is not None and rep > 1 and batch.tokens.shape[1] > 1:
            mask = mask.repeat(1, 1, rep, 1)  # the query heads folded as _paged_attention does
        x = self.model.embed_tokens(batch.tokens)
        layers = self.model.layers
        if self.sums is not None and self.sums.fuses_norms(x):
            normed = layers[0].input_layernorm(x)
            for i, layer in enumerate(layers):
                after = layers[i + 1].input_layernorm if i + 1 < len(layers) else \
                    self.model.norm
                x, normed = layer.forward_normed(x, normed, after, cos, sin, batch, None,
                                                 (kv.k[i], kv.v[i], read, mask))
            return x
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, batch, None, (kv.k[i], kv.v[i], read, mask))
        return x

    def use_kernels(self, attention: bool, activation: bool = False, rows: int = 256) -> None:
        """Route the static decode step's attention, for up to `rows` rows a step, and the
        MLP's activation through the Triton kernels of decode_attention.py and silu_mul.py
        (CUDA only)."""
        if attention or activation:
            from . import decode_attention, silu_mul  # noqa: F401  (registers torch.ops.duet)

            if not decode_attention.available():
                raise RuntimeError("duet's decode kernels need Triton")
        counters = None
        if attention:
            attn = self.model.layers[0].self_attn
            counters = torch.zeros(rows * attn.n_kv, dtype=torch.int32,
                                   device=self.model.embed_tokens.weight.device)
        for layer in self.model.layers:
            layer.self_attn.decode_kernel = attention
            layer.self_attn.counters = counters
            layer.mlp.act_kernel = activation

    @property
    def kv_cache_bytes(self) -> int:
        return sum(layer.self_attn.kv_cache.nbytes for layer in self.model.layers)

    def _prefix_mask(self, start: int, t: int, device) -> torch.Tensor | None:
        window = self.args.sliding_window
        end = start + t
        if (start == 0 or t == 1) and not (window is not None and end > window):
            return None  # plain causal, or one token that sees everything
        q_pos = torch.arange(start, end, device=device)[:, None]
        k_pos = torch.arange(end, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask

    def forward(self, tokens: torch.Tensor, pos: int, last_only: bool = False):
        """Logits for tokens [B, T] at positions pos.. over the contiguous cache installed by
        scratch_cache (scoring, whole-prompt logits); the runtime's steps go through
        forward_paged. `last_only` limits the vocabulary projection to the last position."""
        t = tokens.shape[1]
        if pos + t > self.max_len:
            raise ValueError(f"position {pos + t} is past the KV cache ({self.max_len})")
        if self.mirror is not None:
            self.mirror("forward", tokens.tolist(), pos, last_only)
        cos, sin = self.rope_cos[pos : pos + t], self.rope_sin[pos : pos + t]
        mask = self._prefix_mask(pos, t, tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, pos, mask)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))
