"""How big the KV pool and the batch are by default: modest where the memory is shared (CPU,
MPS, MLX), as large as the memory allows on a CUDA device that is the server's own."""

import pytest

from engines.runtime.sizing import size_pool

GiB = 2**30


def sized(device, free_bytes, max_batch=None, memory_bytes=None, per_token=32 * 1024,
          context=4096):
    pool, batch = size_pool(bytes_per_token=per_token, context_length=context,
                            max_batch=max_batch, memory_bytes=memory_bytes,
                            free_bytes=free_bytes, device=device)
    return pool.capacity_tokens, batch


def test_a_laptop_gets_32_sequences_and_at_most_half_its_free_memory():
    assert sized("cpu", 64 * GiB) == (32 * 4096, 32)  # 32 full contexts fit in half
    assert sized("mps", 2 * GiB) == (GiB // (32 * 1024), 32)  # half of 2 GiB is less
    assert sized("cpu", None, max_batch=4) == (4 * 4096, 4)  # MLX: no free figure


@pytest.mark.parametrize("free, batch", [
    (120 * GiB, 128),  # an H200 after a 1B model's weights: the batch's ceiling
    (GiB, 32),  # a small GPU after a big model: the floor
    (4 * GiB, 51),  # 80% of 4 GiB: 102k tokens of 32 KiB, 51 sequences of 2048
    (5 * GiB, 64),
])
def test_a_cuda_device_sizes_the_batch_from_its_memory(free, batch):
    tokens, got = sized("cuda:0", free)
    assert got == batch
    assert tokens == min(batch * 4096, int(free * 0.8) // (32 * 1024)) // 16 * 16


def test_what_is_asked_for_is_what_is_given():
    assert sized("cuda", 120 * GiB, max_batch=8) == (8 * 4096, 8)
    # A KV size of 1 GiB on CUDA: the batch follows it (32k tokens: 16 sequences, so 32).
    assert sized("cuda", 120 * GiB, memory_bytes=GiB) == (32768, 32)
    assert sized("cuda", 120 * GiB, memory_bytes=16 * GiB)[1] == 128


def test_a_limit_bounds_the_default_pool_but_not_an_explicit_one():
    from engines.runtime.sizing import size_pool

    # the memory budget leaves 100 tokens' bytes: the default (32 x 64 tokens) is cut to it
    pool, _ = size_pool(bytes_per_token=10, context_length=64, max_batch=None,
                        memory_bytes=None, free_bytes=None, limit_bytes=1000)
    assert pool.capacity_tokens <= 100
    # on a GPU the memory free once loaded bounds it too
    pool, batch = size_pool(bytes_per_token=10, context_length=64, max_batch=None,
                            memory_bytes=None, free_bytes=10_000, device="cuda",
                            limit_bytes=1_000_000)
    assert pool.capacity_tokens <= 10_000 // 10
    # --kv-cache-memory is the user's own number
    pool, _ = size_pool(bytes_per_token=10, context_length=64, max_batch=None,
                        memory_bytes=5000, free_bytes=None, limit_bytes=1000)
    assert 480 <= pool.capacity_tokens <= 500  # whole blocks of 16


def test_an_engine_declares_its_facts_and_allocates_what_the_runtime_decides():
    """The engine's side is its KV facts and the storage; the pool, the batch, the prefill
    budget and the context served are decided by the runtime's rules alone."""
    from engines.generation import GenerationEngine
    from engines.runtime.sizing import KVFacts, RuntimeOptions

    class Engine(GenerationEngine):
        name = "probe"

        def __init__(self):
            self.allocated = []

        def allocate_kv(self, shape):
            self.allocated.append(shape)

    engine = Engine()
    # 1,000 bytes a token, 100,000 bytes free on a CUDA device: 80 tokens fit, 5 blocks.
    shape = engine.start_runtime(KVFacts(1000, 4096, "cuda:0", free_bytes=100_000),
                                 RuntimeOptions(max_batch=2, prefix_cache=False))
    assert engine.allocated == [shape]
    assert (shape.pool.capacity_tokens, shape.max_batch) == (80, 2)
    assert shape.context_length == engine.context_length == 80  # what the pool holds
    assert shape.max_prefill_tokens == engine.max_prefill_tokens == 2048  # CUDA's default
    assert engine.kv_pool is shape.pool and engine.prefix_cache is False
    # Asked for: the server's numbers win over the device's defaults.
    shape = Engine().start_runtime(KVFacts(1000, 64, "cpu"),
                                   RuntimeOptions(kv_cache_memory=640_000, max_prefill_tokens=32))
    assert (shape.pool.capacity_tokens, shape.context_length, shape.max_prefill_tokens) == \
        (640, 64, 32)
