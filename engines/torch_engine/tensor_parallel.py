"""Tensor parallelism: one model split across ranks by attention heads and MLP units, in the
manner of Megatron-LM and gpt-fast.

Each rank holds a contiguous share of the query heads with their KV heads (Q/K/V projected
column-wise, the output projection row-wise) and of the MLP's hidden units (gate/up
column-wise, down row-wise); each block's two row-wise products are summed over the ranks
(Sums), so every rank ends each layer with the whole hidden state. Embeddings, norms and
the vocabulary projection are whole on every rank. Only rank 0 samples: in a decode step each
rank projects its share of the vocabulary and rank 0 gathers the logits (VocabSplit); outside
the steps rank 0 projects alone. A rank's KV pool holds its own KV heads only.

A rank reads its share of a safetensors checkpoint by slices (safetensors' get_slice), not the
whole file."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..base import UnsupportedModel
from . import peer_sum
from .config import ModelArgs

log = logging.getLogger("duet.engines.torch")


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def part(self, n: int) -> slice:
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)


@dataclass
class Sums:
    """How one rank's partial hidden states are added up over the ranks: by peer sums
    (peer_sum.py) where they are set and the sum fits, else by the group's all-reduce (NCCL on
    CUDA, gloo on the CPU): compiled, as a functional collective, which torch.compile traces
    and a CUDA graph captures; eagerly, in place. One per model, shared by its layers."""

    group: object  # the ranks' torch.distributed process group
    peer: peer_sum.PeerSum | None = None
    # Each peer sum with its residual add and the next norm in one kernel (add_norm; past
    # peer_sum.FUSED_ROWS rows the sum's kernel and then one for the add and norm): opt-in with
    # DUET_TP_FUSED_NORMS=1. Through the server on two H100s (2026-11-26, docs/benchmarks.md)
    # one client decoded at 289.5 tok/s against 288.6 without, 64 clients 10,107 against
    # 9,993: within the spread, since compiled Inductor makes the add and the norm one kernel.
    fused_norms: bool = False

    def __call__(self, x: torch.Tensor, phase: int) -> torch.Tensor:
        if self.peer is not None and self.peer.fits(x):
            return self.peer(x, phase)
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(x, "sum", self.group)
        # Eagerly, in place: the functional collective's tensor subclass and bookkeeping cost
        # the host about 0.3 ms a sum (an eager prefill forward of the 8B shape took twice as
        # long over two GPUs as on one, bound by the host). x is the projection's own output.
        dist.all_reduce(x, group=self.group)
        return x

    def fuses_norms(self, x: torch.Tensor) -> bool:
        """Whether a forward of hidden states like x takes add_norm's one kernel a sum."""
        return self.fused_norms and self.peer is not None and self.peer.fits(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm,
                 phase: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x summed over the ranks, norm of it), in one kernel, for a forward that
        fuses_norms; norm: a model.RMSNorm."""
        return self.peer.add_norm(x, residual, norm.weight, norm.eps, phase)


@dataclass(frozen=True)
class VocabSplit:
    """A decode step's vocabulary projection split over the ranks: each rank multiplies by its
    share of the vocabulary's rows (a view of the whole weight, which every rank holds for the
    forwards outside the steps) and rank 0 gathers the logits (peer_sum.PeerGather). Rank 0
    alone read the whole projection before, a large read (1 GB for the 8B shape) the other
    ranks waited for at the next step's first sum."""

    weight: torch.Tensor  # this rank's rows of the projection's weight (a view)
    gather: peer_sum.PeerGather

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        """Rank 0: the logits [B, V] of final hidden states after the norm [B, H]; another
        rank: an empty [B, 0], to be returned so the compiler keeps the gather."""
        return self.gather(torch.nn.functional.linear(normed, self.weight))


@dataclass
class TokenShare:
    """How a pipelined step's tokens, sampled on rank 0, reach the other ranks (whose next step
    takes its inputs from them on the device): the group's broadcast, or with
    DUET_TP_TOKEN_SHARE=peer (where the peer sums are) through peer memory
    (peer_sum.PeerShare: rank 0 writes and goes on). The broadcast is the one NCCL call left in
    a decode step; the peer share stays opt-in: on two H100s (2026-11-26, docs/benchmarks.md)
    an 8B step took 3.50 ms either way."""

    group: object
    peer: peer_sum.PeerShare | None = None

    def send(self, tokens: torch.Tensor) -> None:
        """Rank 0."""
        if self.peer is not None:
            self.peer.send(tokens)
        else:
            dist.broadcast(tokens, src=0, group=self.group)

    def receive(self, n: int, device: str) -> torch.Tensor:
        """Another rank: rank 0's n tokens (int64, on the device)."""
        if self.peer is not None:
            return self.peer.receive(n)
        tokens = torch.empty(n, dtype=torch.long, device=device)
        dist.broadcast(tokens, src=0, group=self.group)
        return tokens


# The peer sums' buffers hold a prefill forward's sums up to this many tokens (the CUDA default
# budget): 64 MB a rank for the 8B shape (hidden 4096, bf16, two phases, two ranks).
MAX_PEER_TOKENS = 2048


def use_peer_sums(model, device: str, rows: int, tokens: int) -> None:
    """Collective, at the same point on every rank: a tensor-parallel model's sums of up to
    `rows` rows (a decode step's) or `tokens` tokens (a prefill forward's, up to
    MAX_PEER_TOKENS) through peer sums where every rank can make them, and then its decode
    step's vocabulary projection split over the ranks (a plain float projection whose rows
    divide by the ranks), and with DUET_TP_TOKEN_SHARE=peer its sampled tokens shared from
    rank 0 through peer memory."""
    if model.sums is None:
        return
    group = model.sums.group
    dtype = model.model.embed_tokens.weight.dtype
    model.sums.peer = peer_sum.create(
        group, device, max(rows, min(tokens, MAX_PEER_TOKENS)) * model.args.hidden_size, dtype)
    model.sums.fused_norms = os.environ.get("DUET_TP_FUSED_NORMS") == "1"
    world, vocab = dist.get_world_size(group), model.args.vocab_size
    if model.sums.peer is not None and type(model.lm_head) is nn.Linear and not vocab % world:
        part = vocab // world
        gather = peer_sum.create_gather(group, device, rows, part, dtype)
        if gather is not None:
            rank = dist.get_rank(group)
            model.vocab_split = VocabSplit(
                model.lm_head.weight[rank * part:(rank + 1) * part], gather)
    if model.sums.peer is not None and os.environ.get("DUET_TP_TOKEN_SHARE") == "peer":
        model.token_share.peer = peer_sum.create_share(group, device, rows, dtype)
    log.info("tensor parallelism: sums %s; the decode step's vocabulary projection %s; its "
             "sampled tokens to the other ranks %s",
             f"of up to {model.sums.peer.capacity // model.args.hidden_size} rows through peer "
             "sums, larger through the group's all-reduce" if model.sums.peer else
             "through the group's all-reduce",
             "split over the ranks" if model.vocab_split else "whole on rank 0",
             "through peer memory" if model.token_share.peer else "by the group's broadcast")


def check_splits(args: ModelArgs, world: int) -> None:
    for what, n in (("attention heads", args.num_heads), ("KV heads", args.num_kv_heads),
                    ("MLP hidden units", args.intermediate_size)):
        if n % world:
            raise UnsupportedModel(
                f"tensor parallelism over {world} ranks needs the model's {what} ({n}) to "
                f"divide by {world}")


def split_modules(model, shard: Shard, group) -> None:
    """Shrink a model made on the meta device to one rank's share (weights not yet loaded);
    group: the ranks' process group its blocks sum over."""
    args = model.args
    model.sums = sums = Sums(group)
    model.token_share = TokenShare(group)
    check_splits(args, shard.world)
    d, w = args.hidden_size, shard.world
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.n_heads //= w
        attn.n_kv //= w
        attn.q_size, attn.kv_size = attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim
        attn.qkv_proj = nn.Linear(d, attn.q_size + 2 * attn.kv_size, bias=args.qkv_bias,
                                  device="meta")
        attn.o_proj = nn.Linear(attn.q_size, d, bias=args.o_bias, device="meta")
        mlp.hidden //= w
        mlp.gate_up_proj = nn.Linear(d, 2 * mlp.hidden, bias=args.mlp_bias, device="meta")
        mlp.down_proj = nn.Linear(mlp.hidden, d, bias=args.mlp_bias, device="meta")
        layer.sums = sums


# Hugging Face names (after "model.layers.N.") split by rows (outputs) or columns (inputs), and
# the size of the axis split: heads x head_dim, or the MLP's hidden units.
_ROWS = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
         "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
_COLUMNS = {"self_attn.o_proj": "q", "mlp.down_proj": "mlp"}


def _axis(args: ModelArgs, kind: str) -> int:
    return {"q": args.num_heads * args.head_dim, "kv": args.num_kv_heads * args.head_dim,
            "mlp": args.intermediate_size}[kind]


def shard_of(name: str, tensor_slice, args: ModelArgs, shard: Shard) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `name`, read through tensor_slice (a
    safetensors slice, or a tensor: anything indexed by slices)."""
    module, _, kind = name.rpartition(".")
    local = module.split(".", 3)[-1] if module.startswith("model.layers.") else module
    if local in _ROWS:
        return tensor_slice[shard.part(_axis(args, _ROWS[local]))]
    if local in _COLUMNS:
        if kind == "bias":  # added once, after the sum: rank 0's alone
            whole = tensor_slice[:]
            return whole if shard.rank == 0 else torch.zeros_like(whole)
        return tensor_slice[:, shard.part(_axis(args, _COLUMNS[local]))]
    return tensor_slice[:]


def read_shard(files: list[Path], args: ModelArgs, shard: Shard, tie: bool) -> dict[str, torch.Tensor]:
    """One rank's tensors of a safetensors checkpoint, each read as its slice."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not (tie and name == "lm_head.weight"):
                    state[name] = shard_of(name, f.get_slice(name), args, shard)
    return state

