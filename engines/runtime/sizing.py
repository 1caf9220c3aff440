"""How big the KV pool and the batch are: the one place these limits are decided, for every
engine, and how they are reported."""

from __future__ import annotations

import logging

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
# weights loaded, and no more than max_batch full contexts need.
FREE_MEMORY_SHARE = 0.5


def prefill_budget(requested: int | None, device: str) -> int:
    if requested is not None:
        return requested
    return CUDA_MAX_PREFILL_TOKENS if device.startswith("cuda") else DEFAULT_MAX_PREFILL_TOKENS


def size_pool(*, bytes_per_token: int, context_length: int, max_batch: int,
              memory_bytes: int | None, free_bytes: int | None,
              block_size: int = BLOCK_SIZE) -> BlockPool:
    if memory_bytes is not None:
        tokens = memory_bytes // bytes_per_token
    else:
        tokens = max_batch * context_length
        if free_bytes is not None:
            tokens = min(tokens, int(free_bytes * FREE_MEMORY_SHARE) // bytes_per_token)
    blocks = max(1, tokens // block_size)
    return BlockPool(blocks, block_size, bytes_per_token)


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
