"""Continuous batching on the torch engine: every request of a batch gets the tokens it gets
alone (greedy, float32), whatever joins or leaves around it, however its prompt is chunked;
seeded sampling gives a row the same draws alone and in a batch."""

import time

import pytest
import torch

from engines.base import SamplingParams, Step
from engines.runtime.runtime import Runtime, Submission
from engines.torch_engine import TorchEngine
from tests.engines.helpers import BATCH_PROMPTS as PROMPTS
from tests.engines.helpers import GREEDY, alone, run_together, three_in_a_nine_block_pool
from tests.tiny_models import FAMILIES


def engine_for(tiny_dirs, family, **options):
    return TorchEngine(tiny_dirs[family][0], context_length=96, dtype="float32", device="cpu",
                       **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_mixed_prompts_gives_each_its_solo_tokens(tiny_dirs, family):
    engine = engine_for(tiny_dirs, family)
    expected = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    # Arrivals spread over steps: requests join a running batch and leave it mid-way.
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=64)
    got, stats = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
    assert got == expected
    assert [s.completion_tokens for s in stats] == [g.max_tokens for g in GREEDY]
    assert engine.kv_pool.used_blocks == 0  # every block back in the pool


def test_chunked_prefill_gives_the_same_tokens(tiny_dirs):
    engine = engine_for(tiny_dirs, "mistral_window")
    expected = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    runtime = Runtime(engine, max_batch=5, max_prefill_tokens=6)  # prompts cut in 6-token chunks
    got, _ = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 1, 1, 4, 6])
    assert got == expected


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_dirs):
    engine = engine_for(tiny_dirs, "llama")
    params = [SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, seed=s,
                             ignore_eos=True)
              for t, k, p, s in [(1.0, 0, 1.0, 1), (0.8, 20, 1.0, 2), (1.3, 0, 0.9, 3),
                                 (0.0, 0, 1.0, None), (1.0, 50, 0.8, 4)]]
    expected = [alone(engine, p, s) for p, s in zip(PROMPTS, params)]
    runtime = Runtime(engine, max_batch=5, max_prefill_tokens=16)
    got, _ = run_together(runtime, list(zip(PROMPTS, params)), join_at=[0, 2, 0, 1, 5])
    assert got == expected
    assert alone(engine, PROMPTS[0], params[0]) != alone(
        engine, PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=99,
                                           ignore_eos=True))


def test_a_pool_too_small_for_everyone_preempts_and_still_gives_solo_tokens(tiny_dirs):
    """Three requests that need 4 blocks each share a 9-block pool: the newest is preempted
    when the others grow, recomputed later, and still gets its own tokens."""
    engine = engine_for(tiny_dirs, "llama", kv_cache_memory=None)
    jobs, expected, runtime = three_in_a_nine_block_pool(engine)
    seen = []
    original = runtime.scheduler.schedule

    def schedule():
        plan = original()
        seen.append((engine.kv_pool.used_blocks, len(plan.rows), plan.released))
        return plan

    preempted = []
    preempt = runtime.scheduler._preempt
    runtime.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    runtime.scheduler.schedule = schedule
    got, stats = run_together(runtime, jobs)
    assert got == expected
    assert max(used for used, _, _ in seen) <= 9
    assert preempted  # the pool ran dry at least once
    assert stats[2].queue_s >= 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_mlx_engine_batches_to_the_same_tokens(tiny_dirs, family):
    """On mlx-lm's BatchGenerator: requests joining and leaving, prompts of mixed lengths."""
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    engine = MLXEngine(tiny_dirs[family][0], context_length=96, dtype="float32")
    expected = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=8)
    got, stats = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
    assert got == expected
    assert [s.completion_tokens for s in stats] == [g.max_tokens for g in GREEDY]
    assert engine.kv_pool.used_blocks == 0


def test_the_mlx_engine_preempts_in_a_pool_too_small_and_stops_when_done(tiny_dirs):
    """The torch test above on mlx-lm's BatchGenerator: the newest request leaves the batch
    when the pool runs dry, comes back and still gets its solo tokens; once every request is
    done the runtime has no work and a step asks nothing of the executor."""
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    engine = MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32")
    jobs, expected, runtime = three_in_a_nine_block_pool(engine)
    preempted = []
    preempt = runtime.scheduler._preempt
    runtime.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    got, stats = run_together(runtime, jobs)
    assert got == expected
    assert preempted
    assert [s.completion_tokens for s in stats] == [40] * 3
    for _ in range(3):  # an executor that answers late may still hold a step's work
        runtime.step()
    assert not runtime.has_work and engine.kv_pool.used_blocks == 0
    launched = []
    launch = runtime.executor.launch
    runtime.executor.launch = lambda plan: (launched.append(plan), launch(plan))[1]
    runtime.step()
    assert launched == []


def test_mlx_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_dirs):
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    engine = MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32")
    params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=s,
                             ignore_eos=True)
              for t, k, p, s in [(1.0, 0, 1.0, 1), (0.8, 20, 1.0, 2), (1.3, 0, 0.9, 3)]]
    expected = [alone(engine, p, s) for p, s in zip(PROMPTS, params)]
    got, _ = run_together(Runtime(engine, max_batch=3), list(zip(PROMPTS, params)),
                          join_at=[0, 1, 0])
    assert got == expected


def counting_inserts(tiny_dirs, gather_s: float, quiet_s: float = 0.0):
    """An MLX runtime of 4 rows whose generator counts the prompts of each insert; four greedy
    jobs and the tokens each gets alone. quiet_s 0: an idle generator takes a prompt at once."""
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    engine = MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", max_batch=4)
    jobs = list(zip(PROMPTS[:4], [SamplingParams(max_tokens=12, temperature=0.0,
                                                 ignore_eos=True)] * 4))
    expected = [alone(engine, p, g) for p, g in jobs]
    runtime = Runtime(engine, max_batch=4)
    runtime.executor.gather_s = gather_s
    runtime.executor.quiet_s = quiet_s
    calls = []
    add = runtime.executor._add
    runtime.executor._add = lambda rows: (calls.append(len(rows)), add(rows))[1]
    return runtime, jobs, expected, calls


@pytest.mark.parametrize("gather_s, inserts", [(60.0, 2), (0.0, 4)])
def test_mlx_prompts_arriving_while_others_decode_join_together(tiny_dirs, gather_s, inserts):
    """Each join is a merge of caches into the running batch: prompts that arrive one a step
    while a batch runs are gathered (up to gather_s) and join at once, and still get their
    solo tokens."""
    runtime, jobs, expected, calls = counting_inserts(tiny_dirs, gather_s)
    got, _ = run_together(runtime, jobs, join_at=[0, 2, 3, 4])
    assert got == expected
    assert len(calls) == inserts and sum(calls) == 4


def test_mlx_gathered_prompts_join_at_the_first_step_without_a_newcomer(tiny_dirs):
    """A burst is over when a step brings no new prompt: what was gathered joins then, without
    waiting out gather_s (prompts at steps 2 and 3, then one at step 6: two joins after the
    first prompt's own)."""
    runtime, jobs, expected, calls = counting_inserts(tiny_dirs, 60.0)
    got, _ = run_together(runtime, jobs, join_at=[0, 2, 3, 6])
    assert got == expected
    assert calls == [1, 2, 1]


def test_an_idle_mlx_generator_holds_a_burst_until_it_goes_quiet(tiny_dirs):
    """The head of a burst reaching an idle batch does not join alone: prompts keep gathering
    while they come less than quiet_s apart (here: forever), and join at once when the batch
    is full; then a lone prompt is taken once quiet_s passes without a newcomer."""
    runtime, jobs, expected, calls = counting_inserts(tiny_dirs, 60.0, quiet_s=60.0)
    got, _ = run_together(runtime, jobs, join_at=[0, 1, 1, 3])
    assert got == expected
    assert calls == [4]
    runtime.executor.quiet_s = 0.01
    started = time.perf_counter()
    got, _ = run_together(runtime, jobs[:1])
    assert got == expected[:1] and calls == [4, 1]
    assert time.perf_counter() - started >= 0.01


def test_mlx_prompts_arriving_together_join_at_once_and_prefill_within_the_budget(
        tiny_dirs, monkeypatch):
    """The scheduler hands an MLX engine every prompt that fits at once, whatever the step's
    prefill budget (one join: one merge for them all, where the budget used to split them into
    groups that each joined on their own); the batch then prefills them a chunk a step, the
    budget shared among the prompts being prefilled."""
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    engine = MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32",
                       max_prefill_tokens=8)
    jobs = [(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4])]
    expected = [alone(engine, p, g) for p, g in jobs]
    runtime = Runtime(engine, max_batch=4)
    runtime.executor.min_chunk = 1
    inserts = []
    add = runtime.executor._add
    runtime.executor._add = lambda rows: (inserts.append(len(rows)), add(rows))[1]
    shapes = []
    model_class = type(runtime.executor._model)
    forward = model_class.__call__
    monkeypatch.setattr(model_class, "__call__",
                        lambda self, inputs, *a, **kw: (shapes.append(inputs.shape),
                                                        forward(self, inputs, *a, **kw))[1])
    got, _ = run_together(runtime, jobs)
    assert got == expected
    assert inserts == [4]
    prefill = [(rows, width) for rows, width in shapes if width > 1]
    assert prefill and max(rows * width for rows, width in prefill) <= 8, prefill


def test_a_failed_step_of_a_late_answering_executor_fails_every_sequence_awaiting_it():
    """MLX answers a sequence's token a step or more after the plan that asked for it, and
    runs its whole batch each step: when a step raises, the sequences awaiting a token (which
    that plan does not carry) fail too, instead of waiting for an answer that never comes."""
    from engines.fake import FakeEngine, FakeExecutor
    from engines.runtime.plan import ExecutorTraits, StepOutput

    class Late(FakeExecutor):
        def __init__(self, engine):
            super().__init__(engine)
            self.traits = ExecutorTraits(answers_late=True)
            self.held: dict[int, int] = {}
            self.steps = 0

        def launch(self, plan):
            self.steps += 1
            if self.steps == 4:
                raise RuntimeError("the device went away")
            answered, self.held = self.held, dict(super().launch(plan).tokens)
            return StepOutput(answered)

    engine = FakeEngine(reply="x" * 30, max_batch=4)
    engine.executor = lambda **options: Late(engine)
    runtime = Runtime(engine)
    events: dict[str, list] = {"a": [], "b": []}
    params = SamplingParams(max_tokens=20, temperature=0.0)
    runtime.add(Submission([1, 2, 3], params, events["a"].append))
    runtime.step()
    runtime.add(Submission([4, 5], params, events["b"].append))
    for _ in range(10):
        if not runtime.has_work:
            break
        runtime.step()
    assert not runtime.has_work
    for name, got in events.items():
        assert isinstance(got[-1], RuntimeError), name


def test_the_mlx_warm_up_runs_a_join_a_sampled_row_and_a_leave(tiny_dirs, monkeypatch):
    """MLX's CUDA backend compiles the kernels of a join (caches padded and merged), of a
    leave and of a wide prefill the first time they run: the warm-up at load (on a GPU) runs
    each once, so the first clients that arrive together do not wait seconds for it."""
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine
    from engines.mlx_engine.batch import Batch
    from engines.mlx_engine.executor import MLXExecutor
    from engines.mlx_engine.warm_up import warm_up_batching

    engine = MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32")
    calls = []
    add, remove = MLXExecutor._add, Batch.remove

    def counting_add(self, rows):
        calls.append(("join", sorted(len(r.tokens) for r in rows), len(self._batch),
                      sum(not r.sampling.greedy for r in rows)))
        return add(self, rows)

    def counting_remove(self, seq_ids, keep_kv):
        leaving = len(set(seq_ids) & set(self.seq_ids))
        if leaving:
            calls.append(("leave", leaving, len(self)))
        return remove(self, seq_ids, keep_kv)

    monkeypatch.setattr(MLXExecutor, "_add", counting_add)
    monkeypatch.setattr(Batch, "remove", counting_remove)
    assert warm_up_batching(engine) > 0
    # One prompt alone, then two of other lengths (one sampled) joining it while it decodes.
    assert calls[:2] == [("join", [5], 0, 0), ("join", [3, 9], 1, 1)]
    leaves = [c for c in calls if c[0] == "leave"]
    assert leaves and leaves[0][2] == 3  # the first leaves while the other two run
    # Then a wider prefill at once, as a burst of clients brings.
    rows = min(8, engine.max_batch)
    assert ("join", [64] * rows, 0, 0) in calls, calls


def test_a_step_that_runs_the_device_out_of_memory_fails_its_requests_and_the_rest_go_on(
        tiny_dirs, monkeypatch):
    """torch's OutOfMemoryError in a step fails the requests that step carried with the
    engine's DeviceOutOfMemory (the server's 503, not a 500), in a line without the allocator's
    advice; the request already running keeps its tokens, and the next one is served."""
    from engines.base import DeviceOutOfMemory

    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    solo = [alone(engine, p, params) for p in PROMPTS]
    runtime = Runtime(engine)
    real, launches = runtime.executor._launch, []

    def launch(plan):
        launches.append([r.seq_id for r in plan.prefill])
        if len(launches) == 3:  # the second request's prefill, beside the first's decode
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
                "of 79.18 GiB of which 12.94 MiB is free. If reserved but unallocated memory "
                "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return real(plan)

    monkeypatch.setattr(runtime.executor, "_launch", launch)
    events = {i: [] for i in range(3)}
    runtime.add(Submission(PROMPTS[0], params, events[0].append))
    runtime.step()
    runtime.step()
    runtime.add(Submission(PROMPTS[1], params, events[1].append))
    while runtime.has_work:
        runtime.step()
    failed = events[1][-1]
    assert isinstance(failed, DeviceOutOfMemory) and len(events[1]) == 1
    assert "ran out of memory" in str(failed) and "20.00 MiB" in str(failed)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in str(failed)
    first = [e.token_id for e in events[0] if isinstance(e, Step)]
    # The failed step carried the first request's decode row too: it failed with it, its
    # tokens until then its solo ones.
    assert first == solo[0][:len(first)]
    runtime.add(Submission(PROMPTS[2], params, events[2].append))
    while runtime.has_work:
        runtime.step()
    assert [e.token_id for e in events[2] if isinstance(e, Step)][:-1] == solo[2]
