"""The prefix cache: the pool's account of cached blocks (keys, holders, least-recently-used
eviction), the scheduler feeding a sequence from where its cached prefix ends, and the torch
engine giving the tokens of a cold prefill from a warm one, alone and inside a batch."""

import pytest

from engines.base import SamplingParams
from engines.runtime.kv import ROOT, BlockPool, chain
from engines.runtime.plan import RowSampling, StepOutput
from engines.runtime.runtime import Runtime
from engines.runtime.scheduler import Scheduler, Sequence
from tests.engines.helpers import make_engine, run_together


def cache(pool, blocks, tokens):
    """Register blocks (full, in order) as holding tokens; their keys."""
    keys, parent = [], ROOT
    size = pool.block_size
    for j, block in enumerate(blocks):
        chunk = tuple(tokens[j * size:(j + 1) * size])
        key = chain(parent, chunk)
        pool.register(block, key, parent, chunk)
        keys.append(key)
        parent = key
    return keys


def test_cached_blocks_are_taken_by_the_prefix_they_hold_and_evicted_last_used_first():
    pool = BlockPool(6, 4)
    a, b = [], []
    assert pool.grow(a, 12) and pool.grow(b, 8)  # a: 3 blocks, b: 2
    tokens_a, tokens_b = list(range(12)), [9] * 8
    keys = cache(pool, a, tokens_a)
    cache(pool, b, tokens_b)
    assert pool.cached_blocks == 5 and pool.free_blocks == 1
    # Held blocks are shared: a second holder takes them, at most `limit` tokens' worth.
    got, got_keys = pool.take_cached(tokens_a + [50], 11)
    assert got == a[:2] and got_keys == keys[:2]
    assert pool.take_cached([0, 1, 2, 99, 4], 5) == ([], [])  # differs in the first block
    pool.release(got)
    first_a = list(a)
    pool.release(a)
    pool.release(b)  # released last: used most recently
    assert pool.used_blocks == 0 and pool.free_blocks == 6 and pool.cached_blocks == 5
    # Growing takes the never-used block, then evicts a's blocks (a's last first), then b's.
    new = []
    assert pool.grow(new, 8)
    assert new[1] == first_a[2] and pool.cached_blocks == 4
    assert pool.take_cached(tokens_a, 12)[0] == first_a[:2]  # a's first two remain
    assert pool.take_cached(tokens_b, 8)[0] == b_blocks(pool, tokens_b)


def b_blocks(pool, tokens):
    blocks, _ = pool.take_cached(tokens, len(tokens))
    pool.release(list(blocks))
    return blocks


def test_a_dropped_cache_frees_its_evictable_blocks_and_forgets_held_ones():
    pool = BlockPool(4, 4)
    held, gone = [], []
    assert pool.grow(held, 4) and pool.grow(gone, 4)
    cache(pool, held, [1, 2, 3, 4])
    cache(pool, gone, [5, 6, 7, 8])
    pool.release(gone)
    pool.drop_cache()
    assert pool.cached_blocks == 0 and pool.free_blocks == 3
    assert pool.take_cached([1, 2, 3, 4, 5], 5) == ([], [])
    pool.release(held)
    assert pool.free_blocks == 4


def seq(i, prompt, max_tokens=4, echo=False):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            prompt_logprobs=1 if echo else None)
    return Sequence(i, list(prompt), params, RowSampling.of(params, 0))


def run(sched, seqs):
    """Every sequence to its end; the rows each was fed, by seq id."""
    fed = {s.seq_id: [] for s in seqs}
    for s in seqs:
        sched.add(s)
    while sched.has_work:
        plan = sched.schedule()
        for row in plan.rows:
            fed[row.seq_id].append((row.start, len(row.tokens)))
        for s, _ in sched.update(plan, StepOutput({r.seq_id: 7 for r in plan.rows if r.sample})):
            if len(s.generated) >= s.params.max_tokens:
                sched.remove(s)
    return fed


def test_a_sequence_is_fed_from_where_its_cached_prefix_ends():
    pool = BlockPool(32, 4)
    sched = Scheduler(pool, max_batch=4, max_prefill_tokens=64, prefix_cache=True)
    first = list(range(1, 11))  # 10 tokens: 2 full blocks, then 4 generated 7s fill a third
    run(sched, [seq(0, first)])
    assert pool.cached_blocks == 3 and pool.used_blocks == 0
    # The next turn: the first prompt, its answer, and new tokens.
    turn = seq(1, first + [7, 7, 7] + [40, 41, 42])
    fed = run(sched, [turn])
    assert fed[1][0] == (12, 4) and turn.cached_tokens == 12
    assert sched.cached_tokens == 12
    # A prompt held whole by the cache still computes its last token (its logits are due).
    again = seq(2, first[:8])
    assert run(sched, [again])[2][0] == (4, 4) and again.cached_tokens == 4
    # A prompt scored for echo takes nothing from the cache: each position needs its logits.
    echo = seq(3, first, echo=True)
    assert run(sched, [echo])[3][0] == (0, 10) and echo.cached_tokens == 0
    off = Scheduler(BlockPool(32, 4), max_batch=4, max_prefill_tokens=64)
    run(off, [seq(0, first)])
    assert run(off, [seq(1, first)])[1][0] == (0, 10)


def test_two_sequences_share_a_prefix_in_one_batch_and_a_preempted_one_finds_its_own():
    pool = BlockPool(8, 4)
    sched = Scheduler(pool, max_batch=4, max_prefill_tokens=64, prefix_cache=True)
    shared = list(range(1, 9))
    a, b = seq(0, shared + [20], max_tokens=3), seq(1, shared + [30], max_tokens=3)
    sched.add(a)
    sched.schedule()  # a's prompt is fed
    sched.add(b)
    plan = sched.schedule()  # a's blocks are cached now: b shares them
    assert [(r.start, len(r.tokens)) for r in plan.rows if r.seq_id == 1] == [(8, 1)]
    assert a.blocks[:2] == b.blocks[:2] and pool.used_blocks == 4
    sched.update(plan, StepOutput({r.seq_id: 7 for r in plan.rows if r.sample}))
    # b goes (preempted, as when the pool runs dry) and comes back to its cached blocks.
    sched._preempt(b)
    plan = sched.schedule()
    assert [(r.start, r.tokens) for r in plan.rows if r.seq_id == 1] == [(8, (30, 7))]


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_warm_prefix_gives_the_tokens_of_a_cold_prefill_and_prefills_only_the_rest(
        tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    system = [5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200, 13, 14, 15, 16, 17, 18, 19, 20]
    cold = Runtime(engine, max_batch=4, threaded_output=False, prefix_cache=False)
    first = system + [100, 101]
    (answer,), _ = run_together(cold, [(first, greedy)])
    second = first + answer + [60, 61, 62]
    others = [system + [30, 31, 32], [9, 8, 7, 6], system[:17]]
    expected, _ = run_together(cold, [(p, greedy) for p in [second, *others]])
    cold.close()

    warm = Runtime(engine, max_batch=4, threaded_output=False)
    fed = []
    launch = warm.executor.launch
    warm.executor.launch = lambda plan: fed.append(plan) or launch(plan)
    (again,), (stats,) = run_together(warm, [(first, greedy)])
    assert again == answer and stats.cached_tokens == 0
    # The chat's second turn prefills only what the first did not hold; in a batch beside
    # prompts sharing the system prompt, a cold one, and one the cache holds whole.
    fed.clear()
    got, stats = run_together(warm, [(p, greedy) for p in [second, *others]])
    warm.close()
    assert got == expected
    cached = [s.cached_tokens for s in stats]
    if kind == "mlx":  # mlx-lm's caches keep any number of tokens, the 16 a prefix needs
        assert len(first) + len(answer) - 1 <= cached[0] < len(second)
        assert cached[1:] == [len(system), 0, len(system[:17]) - 1]
        return
    block = engine.kv_pool.block_size
    held = (len(first) + len(answer) - 1) // block * block  # the last answer token: not fed
    assert cached[0] == held and held > 0
    assert cached[1] == len(system) // block * block and cached[2] == 0
    first_fed: dict[int, int] = {}  # seq id -> the first position it was fed
    for plan in fed:
        for row in plan.rows:
            first_fed[row.seq_id] = min(first_fed.get(row.seq_id, row.start), row.start)
    assert sorted(first_fed.values()) == sorted(cached)


def test_the_mlx_prompt_cache_keeps_prefixes_within_the_kv_budget():
    """Entries give way, the least recently used first, when the running sequences' KV and
    theirs would exceed the pool's bytes; a taken prefix is a cut copy the caller may extend."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from engines.mlx_engine.prompt_cache import PromptCache

    def layers(n):
        cache = KVCache()
        cache.update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
        return [cache]

    per_token = 2 * 4 * 4  # keys and values, 4 float32 each: the pool's bytes per token too
    pool = BlockPool(8, 16, per_token)  # 128 tokens of budget
    cache = PromptCache(pool)
    a, b = list(range(1, 41)), list(range(100, 140))
    cache.put(a, layers(40))
    cache.put(b, layers(40))
    cache.put(list(range(5)), layers(5))  # too short to keep
    assert len(cache) == 2
    got, n = cache.take(a[:30] + [7, 7])
    assert n == 30 and got[0].offset == 30 and got[0].keys.shape[2] == 30
    got[0].update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))  # as mlx-lm does
    assert cache.take(a + [1])[0][0].keys.sum().item() == 40 * 4  # the kept one is unchanged
    assert cache.take([1, 2, 3] + b) == (None, 0)  # shares no prefix of 16
    running = []
    assert pool.grow(running, 50)  # 64 tokens held by running sequences
    cache.fit()  # 64 + 80 > 128: b, used least recently, goes
    assert len(cache) == 1 and cache.take(b + [1])[1] == 0 and cache.take(a + [1])[1] == 40
    assert pool.grow(running, 100)
    cache.fit()
    assert len(cache) == 0 and cache.nbytes == 0


def test_a_sequence_waits_for_a_running_one_prefilling_its_prefix_then_takes_it():
    """n siblings arrive together: the first prefills the prompt, the others wait for its
    blocks (in the queue, holding those behind them) and prefill only the rest."""
    pool = BlockPool(32, 4)
    sched = Scheduler(pool, max_batch=8, max_prefill_tokens=6, prefix_cache=True)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks and 2
    sibling, other = seq(1, prompt), seq(2, [50, 51, 52])
    sched.add(seq(0, prompt))
    sched.add(sibling)
    sched.add(other)
    starts = []
    for _ in range(10):
        plan = sched.schedule()
        if any(r.seq_id == 1 for r in plan.rows):
            break
        starts.append([(r.seq_id, r.start) for r in plan.rows])
        sched.update(plan, StepOutput({r.seq_id: 7 for r in plan.rows if r.sample}))
    # seq 0 prefills in chunks of 6; seq 1 (and seq 2 behind it) wait for its 3 blocks.
    assert starts == [[(0, 0)], [(0, 6)]]
    assert [(r.seq_id, r.start) for r in plan.rows] == [(0, 12), (1, 12), (2, 0)]
    assert sibling.cached_tokens == 12
