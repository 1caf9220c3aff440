"""The scheduler on its own, with a fake executor: FIFO admission without starvation, joining
and leaving at any step, the batch and KV limits, chunked prefill's budget, preemption."""

import pytest

from engines.base import SamplingParams
from engines.runtime.kv import BlockPool, KVPoolTooSmall
from engines.runtime.plan import RowSampling, StepOutput
from engines.runtime.scheduler import Scheduler, Sequence


def seq(i, prompt_len, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(i, list(range(1, prompt_len + 1)), params, RowSampling.of(params, 0))


def run_step(sched: Scheduler, finish_after: dict | None = None):
    """One step with an executor that samples token 7 for every row due one; sequences leave
    once they have finish_after[seq_id] tokens (default: their max_tokens)."""
    plan = sched.schedule()
    out = StepOutput({r.seq_id: 7 for r in plan.rows if r.sample})
    for s, _ in sched.update(plan, out):
        limit = (finish_after or {}).get(s.seq_id, s.params.max_tokens)
        if len(s.generated) >= limit:
            sched.remove(s)
    return plan


def test_admission_is_first_come_first_served_and_bounded_by_the_batch():
    sched = Scheduler(BlockPool(100, 16), max_batch=2, max_prefill_tokens=1000)
    for i in range(4):
        sched.add(seq(i, 5, max_tokens=3))
    admitted = []
    while sched.has_work:
        plan = run_step(sched)
        assert len(plan.rows) <= 2
        admitted += [r.seq_id for r in plan.prefill]
    assert admitted == [0, 1, 2, 3]


def test_a_big_request_at_the_head_is_not_overtaken_by_small_ones():
    """No starvation: a waiting request that does not fit yet holds back later ones, which
    would otherwise keep taking the blocks it waits for."""
    pool = BlockPool(10, 16)
    sched = Scheduler(pool, max_batch=8, max_prefill_tokens=1000)
    sched.add(seq(0, 100, max_tokens=40))  # 7 blocks for its prompt
    run_step(sched)
    sched.add(seq(1, 60, max_tokens=4))  # 4 blocks: does not fit beside seq 0
    sched.add(seq(2, 5, max_tokens=4))  # would fit, but arrived later
    order = []
    while sched.has_work:
        order += [r.seq_id for r in run_step(sched).prefill]
    assert order == [1, 2]


def test_requests_join_a_running_batch_at_the_next_step_and_leave_it_at_once():
    sched = Scheduler(BlockPool(100, 16), max_batch=8, max_prefill_tokens=1000)
    sched.add(seq(0, 5, max_tokens=10))
    run_step(sched)
    run_step(sched)
    sched.add(seq(1, 5, max_tokens=2))
    plan = run_step(sched)
    assert [r.seq_id for r in plan.decode] == [0] and [r.seq_id for r in plan.prefill] == [1]
    run_step(sched)  # seq 1's second token: it leaves
    plan = sched.schedule()
    assert [r.seq_id for r in plan.rows] == [0] and plan.released == (1,)


def test_an_aborted_sequence_frees_its_blocks_at_once_and_its_row_at_the_next_step():
    pool = BlockPool(4, 16)
    sched = Scheduler(pool, max_batch=8, max_prefill_tokens=1000)
    a, b = seq(0, 40), seq(1, 40)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert [s.seq_id for s in sched.running] == [0] and pool.free_blocks == 1  # b waits
    sched.remove(a)  # the client left
    assert pool.free_blocks == 4
    plan = sched.schedule()
    assert plan.released == (0,) and [r.seq_id for r in plan.prefill] == [1]


def test_chunked_prefill_spends_the_budget_oldest_first_and_decode_rows_cost_nothing():
    sched = Scheduler(BlockPool(100, 16), max_batch=8, max_prefill_tokens=10)
    sched.add(seq(0, 3, max_tokens=50))
    run_step(sched)
    sched.add(seq(1, 25))
    sched.add(seq(2, 7))
    chunks = []
    for _ in range(4):
        plan = run_step(sched)
        assert [r.seq_id for r in plan.decode][:1] == [0]  # the running stream never waits
        assert sum(len(r.tokens) for r in plan.prefill) <= 10
        chunks.append([(r.seq_id, r.start, len(r.tokens), r.sample) for r in plan.prefill])
    assert chunks[0] == [(1, 0, 10, False)]
    assert chunks[1] == [(1, 10, 10, False)]
    assert chunks[2] == [(1, 20, 5, True), (2, 0, 5, False)]
    assert chunks[3] == [(2, 5, 2, True)]


def test_a_scored_prompt_chunk_costs_twice_the_budget_and_its_unscored_tail_once():
    sched = Scheduler(BlockPool(100, 16), max_batch=8, max_prefill_tokens=10)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    scored = Sequence(0, list(range(1, 14)), params, RowSampling.of(params, 0))
    sched.add(scored)
    sched.add(seq(1, 20))
    chunks = [[(r.seq_id, r.start, len(r.tokens)) for r in run_step(sched).prefill]
              for _ in range(4)]
    assert chunks[0] == [(0, 0, 5)]  # 5 scored tokens spend the 10
    assert chunks[1] == [(0, 5, 5)]
    assert chunks[2] == [(0, 10, 3), (1, 0, 4)]  # the scored prompt's end, then 4 plain ones
    assert chunks[3] == [(1, 4, 10)]
    tiny = Scheduler(BlockPool(100, 16), max_batch=8, max_prefill_tokens=1)
    tiny.add(Sequence(0, [1, 2, 3], params, RowSampling.of(params, 0)))
    assert [len(r.tokens) for r in run_step(tiny).prefill] == [1]  # a budget of 1 still moves


def test_the_pool_is_never_exceeded_and_preemption_requeues_the_newest_first():
    pool = BlockPool(6, 4)
    sched = Scheduler(pool, max_batch=8, max_prefill_tokens=1000)
    for i in range(3):
        sched.add(seq(i, 4, max_tokens=12))  # each grows to 16 tokens: 4 blocks
    seen_preempted = []
    original = sched._preempt

    def preempt(s):
        seen_preempted.append((s.seq_id, [r.seq_id for r in sched.running]))
        original(s)

    sched._preempt = preempt
    steps = 0
    while sched.has_work:
        run_step(sched)
        assert pool.used_blocks <= 6
        steps += 1
        assert steps < 500
    assert seen_preempted and all(v == running[-1] for v, running in seen_preempted)
    assert pool.free_blocks == 6


def test_a_request_that_can_never_fit_is_refused_naming_the_limit():
    sched = Scheduler(BlockPool(4, 16), max_batch=8, max_prefill_tokens=1000)
    with pytest.raises(KVPoolTooSmall, match="64 tokens.*--kv-cache-memory"):
        sched.add(seq(0, 60, max_tokens=10))
    sched.add(seq(1, 54, max_tokens=10))  # exactly the pool: it fits


def test_pipelined_steps_feed_pending_tokens_and_stop_at_max_tokens():
    """A pipelined executor is read back one step late: each decode row after the first feeds
    PENDING (the token in flight), the draw count includes it, nothing is scheduled past
    max_tokens, and every block comes back."""
    from engines.runtime.plan import PENDING

    pool = BlockPool(20, 4)
    sched = Scheduler(pool, max_batch=2, max_prefill_tokens=1000, pipelined=True)
    for i, n in enumerate((5, 3)):
        sched.add(seq(i, 5, max_tokens=n))
    launched, fed = None, {0: [], 1: []}
    draws = {0: [], 1: []}
    while sched.has_work or launched is not None:
        plan = sched.schedule()
        for r in plan.decode:
            fed[r.seq_id].append(r.tokens[0])
        for r in plan.rows:
            if r.sample:
                draws[r.seq_id].append(r.draws)
        out = StepOutput({r.seq_id: 10 + r.draws for r in plan.rows if r.sample})
        last, launched = launched, ((plan, out) if plan.rows else None)
        if last is not None:
            for s, _ in sched.update(*last):
                if len(s.generated) >= s.params.max_tokens:
                    sched.remove(s)
    assert draws == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2]}  # max_tokens draws, none beyond
    assert fed[0] == [PENDING] * 4 and fed[1] == [PENDING] * 2
    assert pool.used_blocks == 0


def test_a_late_executor_is_not_fed_a_token_it_has_not_answered():
    """Not pipelined (MLX answers a prompt's first token a step or more later): a sequence with
    a token in flight gets no row until that token arrives."""
    sched = Scheduler(BlockPool(20, 4), max_batch=2, max_prefill_tokens=1000,
                      chunked_prefill=False)
    sched.add(seq(0, 5, max_tokens=3))
    plan = sched.schedule()
    assert [r.sample for r in plan.rows] == [True]
    sched.update(plan, StepOutput({}))  # no answer yet
    assert not sched.schedule().rows
    sched.update(plan, StepOutput({0: 9}))
    row, = sched.schedule().rows
    assert row.tokens == (9,) and row.draws == 1


def test_a_preempted_sequence_is_released_to_the_executor_each_time():
    """The executor drops a preempted sequence's state (MLX keeps its cache) before it is
    prefilled again: every preemption, and every finish, reaches it as a released id."""
    from collections import Counter

    sched = Scheduler(BlockPool(6, 4), max_batch=8, max_prefill_tokens=1000)
    for i in range(3):
        sched.add(seq(i, 4, max_tokens=12))
    preempted = Counter()
    original = sched._preempt
    sched._preempt = lambda s: (preempted.update([s.seq_id]), original(s))
    released = Counter()
    while sched.has_work:
        released.update(run_step(sched).released)
    released.update(sched.take_released())
    assert sum(preempted.values()) > 0
    assert released == Counter({i: preempted[i] + 1 for i in range(3)})


def test_a_waiting_sequence_that_is_removed_never_runs():
    sched = Scheduler(BlockPool(100, 16), max_batch=1, max_prefill_tokens=1000)
    waiting = [seq(i, 5, max_tokens=2) for i in range(3)]
    for s in waiting:
        sched.add(s)
    run_step(sched)  # seq 0 runs; 1 and 2 wait
    sched.remove(waiting[1])  # its client left while it waited
    ran = []
    while sched.has_work:
        ran += [r.seq_id for r in run_step(sched).prefill]
    assert ran == [2] and 1 not in [s.seq_id for s in sched.waiting]


def test_a_sequence_may_take_the_last_free_blocks_exactly():
    pool = BlockPool(4, 16)
    blocks: list[int] = []
    assert pool.grow(blocks, 64) and len(blocks) == 4 and pool.free_blocks == 0
    assert pool.grow(blocks, 64)  # nothing more needed
    assert not pool.grow(blocks, 65) and len(blocks) == 4


def test_an_executor_without_chunked_prefill_gets_every_prompt_that_fits_at_once():
    """MLX prefills on its own terms: prompts are not held back to the step's budget (each
    group would join its running batch on its own), only to the batch and the KV pool."""
    sched = Scheduler(BlockPool(14, 4), max_batch=3, max_prefill_tokens=6,
                      chunked_prefill=False)
    for i in range(4):
        sched.add(seq(i, 10, max_tokens=2))
    plan = sched.schedule()
    assert [(r.seq_id, len(r.tokens)) for r in plan.prefill] == [(0, 10), (1, 10), (2, 10)]
    assert [s.seq_id for s in sched.waiting] == [3]  # the batch is full
    sched2 = Scheduler(BlockPool(5, 4), max_batch=3, max_prefill_tokens=6, chunked_prefill=False)
    for i in range(3):
        sched2.add(seq(i, 10, max_tokens=2))
    assert [r.seq_id for r in sched2.schedule().prefill] == [0]  # 3 blocks each (a token ahead)


def test_pool_too_small_crosses_the_engine_process_pipe_whole():
    """The engine process pickles it to the HTTP side, which answers it as a 400."""
    import pickle

    err = pickle.loads(pickle.dumps(KVPoolTooSmall(5000, 4096)))
    assert type(err) is KVPoolTooSmall
    assert (err.tokens, err.capacity) == (5000, 4096)
    assert str(err) == str(KVPoolTooSmall(5000, 4096))
    assert "5000 tokens" in str(err) and "4096 tokens" in str(err)


@pytest.mark.parametrize("blocks, size", [(0, 16), (4, 0), (0, 0)])
def test_a_pool_without_room_is_refused(blocks, size):
    with pytest.raises(ValueError, match="at least one block of at least one token"):
        BlockPool(blocks, size)


def test_the_smallest_pool_holds_one_token():
    pool = BlockPool(1, 1)
    pool.check_fits(1)
    with pytest.raises(KVPoolTooSmall) as err:
        pool.check_fits(2)
    assert (err.value.tokens, err.value.capacity) == (2, 1)


@pytest.mark.parametrize("batch, budget", [(0, 8), (4, 0), (0, 0)])
def test_a_scheduler_that_could_never_run_a_row_is_refused(batch, budget):
    with pytest.raises(ValueError, match="max_batch and max_prefill_tokens must be at least 1"):
        Scheduler(BlockPool(4, 16), max_batch=batch, max_prefill_tokens=budget)
    Scheduler(BlockPool(4, 16), max_batch=1, max_prefill_tokens=1)


@pytest.mark.parametrize("processes_in_flight", [False, True])
def test_processed_rows_wait_for_their_token_unless_the_executor_processes_in_flight(
        processes_in_flight):
    """Pipelined: a row with penalties or a grammar needs its last token in the host's history
    before its next step, unless the executor processes rows with a token in flight."""
    from engines.grammar import GrammarState
    from engines.processing import Processing

    sched = Scheduler(BlockPool(20, 4), max_batch=2, max_prefill_tokens=1000, pipelined=True,
                      processes_in_flight=processes_in_flight)
    params = SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=1.0)
    penalised = Sequence(0, [1, 2, 3], params, RowSampling.of(params, 0, Processing.of(params)))
    grammar = Processing(grammar=object.__new__(GrammarState))  # never asked: the step is fake
    masked = Sequence(1, [1, 2, 3], params, RowSampling.of(params, 0, grammar))
    sched.add(penalised)
    sched.add(masked)
    assert [r.sample for r in sched.schedule().prefill] == [True, True]
    second = sched.schedule()  # the first step's tokens are not read back yet
    assert [r.seq_id for r in second.decode] == ([0, 1] if processes_in_flight else [])
