"""The KV pool's bookkeeping: storage cut into blocks of `block_size` tokens, handed to
sequences as they grow and taken back when they leave. The storage itself belongs to the
engine (torch tensors, mlx-lm's caches); this is the one account of who holds what.

Blocks, not one slot per sequence: a long conversation and many short ones draw on the same
pool, admission is by tokens actually needed, and a later prefix cache can share a block
between sequences by counting its holders."""

from __future__ import annotations

from ..base import EngineError


class KVPoolTooSmall(EngineError):
    """A request that could not fit even in the empty pool."""

    def __init__(self, tokens: int, capacity: int):
        super().__init__(
            f"this request needs KV cache for {tokens} tokens (prompt plus max_tokens), more "
            f"than the whole KV cache holds ({capacity} tokens; raise --kv-cache-memory or ask "
            "for fewer tokens)"
        )
        self.tokens = tokens
        self.capacity = capacity

    def __reduce__(self):  # pickled across the engine process's pipe
        return type(self), (self.tokens, self.capacity)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        # Popped from the end: the lowest ids go first, which keeps early use compact.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_size * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def check_fits(self, tokens: int) -> None:
        if self.blocks_for(tokens) > self.num_blocks:
            raise KVPoolTooSmall(tokens, self.capacity_tokens)

    def grow(self, blocks: list[int], tokens: int) -> bool:
        """Extend `blocks` (a sequence's, in order) to cover `tokens`; False, changing nothing,
        when the pool has too few free blocks."""
        need = self.blocks_for(tokens) - len(blocks)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            blocks.append(self._free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()
