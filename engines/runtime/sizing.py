"""How big the KV pool and the batch are: the one place these limits are decided, for every
engine, and how they are reported.

An engine declares its facts (KVFacts: bytes a token of KV takes, its context, its device and
the memory free there once its weights loaded); the server's asks come as RuntimeOptions; the
rules here turn both into the RuntimeShape the engine's runtimes share (the pool, the batch,
the prefill budget, the context served), for which the engine only allocates storage."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .kv import BlockPool

log = logging.getLogger("duet.runtime")

DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_PREFILL_TOKENS = 512
# On CUDA a prefill forward costs more in launching its ops from Python than in running them
# (an H200 took ~12 ms for 512 tokens of llama-3.2-1b, eagerly): a larger budget means fewer
# forwards for the same prompts, and a 2048-token chunk still delays the decode rows of its
# step by only a few ms there.
CUDA_MAX_PREFILL_TOKENS = 2048
BLOCK_SIZE = 16
# Without --kv-cache-memory the pool takes at most this share of the memory free after the
# weights loaded, and no more than max_batch full contexts need: on a laptop (CPU, MPS, MLX)
# the memory is everyone's.
FREE_MEMORY_SHARE = 0.5
# A CUDA device is the server's own: the pool takes this share of what the weights left (the
# rest is for activations, CUDA graphs and the allocator's slack), and without --max-batch the
# batch is as many sequences as the pool holds AUTO_SEQUENCE_TOKENS for, between
# DEFAULT_MAX_BATCH and CUDA_MAX_BATCH. On an H200 the 1B shape gave 64 clients 17,539 tok/s
# with a batch of 32 and 29,214 with 128.
CUDA_FREE_MEMORY_SHARE = 0.8
AUTO_SEQUENCE_TOKENS = 2048
CUDA_MAX_BATCH = 128


@dataclass(frozen=True)
class RuntimeOptions:
    """What the server asks of a generating engine's runtime: --kv-cache-memory, the most the
    memory budget leaves (kv_cache_limit), --max-batch, --max-prefill-tokens,
    --no-prefix-cache. None: the device's default."""

    kv_cache_memory: int | None = None
    kv_cache_limit: int | None = None
    max_batch: int | None = None
    max_prefill_tokens: int | None = None
    prefix_cache: bool = True


@dataclass(frozen=True)
class KVFacts:
    """What an engine declares for its runtime to be sized."""

    bytes_per_token: int  # KV bytes a token takes (on each rank, split over several)
    context_length: int  # the longest prompt plus completion the model is served with
    device: str
    # Memory free on the device once the weights loaded; None where the pool's size is not
    # bounded by it (MLX's caches grow as they fill: the pool is their account).
    free_bytes: int | None = None


@dataclass(frozen=True)
class RuntimeShape:
    """The runtime's decisions, which every runtime made over one engine shares."""

    pool: BlockPool
    max_batch: int
    max_prefill_tokens: int
    context_length: int  # the facts' context, or what the pool holds if that is less
    prefix_cache: bool

    def describe(self) -> str:
        return describe_pool(self.pool, self.max_batch)

    def info(self) -> dict[str, str]:
        return pool_info(self.pool, self.max_batch)


def shape_runtime(engine: str, facts: KVFacts, options: RuntimeOptions) -> RuntimeShape:
    pool, max_batch = size_pool(
        bytes_per_token=facts.bytes_per_token, context_length=facts.context_length,
        max_batch=options.max_batch, memory_bytes=options.kv_cache_memory,
        free_bytes=facts.free_bytes, limit_bytes=options.kv_cache_limit, device=facts.device)
    return RuntimeShape(pool, max_batch,
                        prefill_budget(options.max_prefill_tokens, facts.device),
                        fit_context(facts.context_length, pool, engine), options.prefix_cache)


def prefill_budget(requested: int | None, device: str) -> int:
    if requested is not None:
        return requested
    return CUDA_MAX_PREFILL_TOKENS if device.startswith("cuda") else DEFAULT_MAX_PREFILL_TOKENS


def size_pool(*, bytes_per_token: int, context_length: int, max_batch: int | None,
              memory_bytes: int | None, free_bytes: int | None, device: str = "cpu",
              block_size: int = BLOCK_SIZE, limit_bytes: int | None = None
              ) -> tuple[BlockPool, int]:
    """The KV pool and the batch size (max_batch, or the device's default when None).
    limit_bytes: the most the default may take (what the server's memory budget leaves)."""
    cuda = device.startswith("cuda")
    share = CUDA_FREE_MEMORY_SHARE if cuda else FREE_MEMORY_SHARE
    room = None if free_bytes is None else int(free_bytes * share) // bytes_per_token
    if limit_bytes is not None and memory_bytes is None:
        limit = limit_bytes // bytes_per_token
        room = limit if room is None else min(room, limit)
    if max_batch is None:
        max_batch = DEFAULT_MAX_BATCH
        if cuda:
            held = (memory_bytes // bytes_per_token if memory_bytes is not None
                    else room if room is not None else 0)
            max_batch = min(CUDA_MAX_BATCH, max(DEFAULT_MAX_BATCH, held // AUTO_SEQUENCE_TOKENS))
    if memory_bytes is not None:
        tokens = memory_bytes // bytes_per_token
    else:
        tokens = max_batch * context_length
        if room is not None:
            tokens = min(tokens, room)
    blocks = max(1, tokens // block_size)
    return BlockPool(blocks, block_size, bytes_per_token), max_batch


def fit_context(context_length: int, pool: BlockPool, engine: str) -> int:
    """The context a request may use: at most what the whole pool holds."""
    if pool.capacity_tokens >= context_length:
        return context_length
    log.warning(
        "%s engine: the KV cache holds %d tokens, fewer than the model's context of %d: "
        "serving a context of %d (raise --kv-cache-memory for more)",
        engine, pool.capacity_tokens, context_length, pool.capacity_tokens,
    )
    return pool.capacity_tokens


def describe_pool(pool: BlockPool, max_batch: int) -> str:
    return (f"KV cache {pool.capacity_bytes / 2**20:.0f} MiB ({pool.capacity_tokens} tokens in "
            f"{pool.num_blocks} blocks of {pool.block_size}), up to {max_batch} sequences a step")


def pool_info(pool: BlockPool, max_batch: int) -> dict[str, str]:
    return {"kv_cache_bytes": str(pool.capacity_bytes),
            "kv_cache_tokens": str(pool.capacity_tokens), "max_batch": str(max_batch)}
