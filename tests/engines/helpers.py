"""What the engine tests of batched generation share: prompts, an engine of either kind on a
tiny checkpoint, and a runtime driven over a batch whose requests arrive at given steps."""

import threading

import pytest

from engines.base import RequestStats, SamplingParams, Step
from engines.runtime.runtime import Runtime, Submission
from engines.torch_engine import TorchEngine

PROMPTS = [[5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200], [9, 8], [100, 101, 102, 103, 104]]


class ReplayedGraphs:
    """A stand-in for cuda_graphs.CudaGraphs on the CPU: capture() runs the step once and keeps
    its outputs; a replay runs the step again and copies the results into those outputs, as a
    CUDA graph's replay overwrites them."""

    def __init__(self):
        self.captured = []
        self.beside = False  # as CudaGraphs: set when the captures run beside the steps

    def capture(self, step):
        out = step()
        self.captured.append(out)

        def replay():
            for kept, new in zip(out, step()):
                kept.copy_(new)

        return replay, out

    def synchronize(self):
        pass


class GatedGraphs(ReplayedGraphs):
    """ReplayedGraphs whose captures wait until the gate opens: graphs captured beside the
    steps (GraphDecoder.warm_up_beside) arrive when a test says."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def capture(self, step):
        assert self.gate.wait(60), "the gate never opened"
        return super().capture(step)


def make_engine(kind, path):
    """kind: "torch", "mlx", or "torch-graphs" (the torch engine's pipelined step through its
    CUDA graph decoder, replayed on the CPU by ReplayedGraphs)."""
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
        from engines.mlx_engine import MLXEngine

        return MLXEngine(path, context_length=96, dtype="float32")
    engine = TorchEngine(path, context_length=96, dtype="float32", device="cpu")
    if kind == "torch-graphs":
        from engines.torch_engine.cuda_graphs import GraphDecoder

        engine.decoder = GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                      graphs=ReplayedGraphs())
    return engine


def run_batch(engine, params, join_at, prompts=None):
    """Every request's Steps (the closing one left out), arriving at the given steps; request i
    has prompts[i] (default PROMPTS[i])."""
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=64, threaded_output=False)
    steps = {i: [] for i in range(len(params))}
    done = set()

    def emit_for(i):
        def emit(event):
            if isinstance(event, BaseException):
                raise event
            if not isinstance(event, Step):
                done.add(i)
            elif event.finish_reason is None:
                steps[i].append(event)
        return emit

    n = 0
    while len(done) < len(params):
        for i, p in enumerate(params):
            if join_at[i] == n:
                runtime.add(Submission(list((prompts or PROMPTS)[i]), p, emit_for(i)))
        runtime.step()
        n += 1
        assert n < 500
    return [steps[i] for i in range(len(params))]


def processing_rule(x, params, prompt, generated):
    """engines/processing.py's rule written out plainly on one row of logits x (a numpy array
    or a tensor, changed in place and returned): the repetition penalty on the raw logits, then
    the bias and the completion's penalties added."""
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, b in params.logit_bias:
        x[t] += b
    for t in set(generated):
        x[t] -= params.presence_penalty + params.frequency_penalty * list(generated).count(t)
    return x


def run_together(runtime, jobs, join_at=None, record=lambda step: step.token_id,
                 after_step=None):
    """jobs: (prompt, params). join_at[i]: the step at which job i arrives (default 0).
    Returns each job's record(step) of its steps (default: the token ids) and stats;
    after_step() is called after every step."""
    join_at = join_at or [0] * len(jobs)
    got = {i: [] for i in range(len(jobs))}
    stats = {}

    def emit_for(i):
        def emit(event):
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, RequestStats):
                stats[i] = event
            elif event.finish_reason is None:
                got[i].append(record(event))
        return emit

    step = 0
    while len(stats) < len(jobs):
        for i, (prompt, params) in enumerate(jobs):
            if join_at[i] == step:
                runtime.add(Submission(list(prompt), params, emit_for(i)))
        runtime.step()
        runtime.delivery.drain()  # the step's events are out (a threaded delivery's too)
        if after_step is not None:
            after_step()
        step += 1
        assert step < 1000
    return [got[i] for i in range(len(jobs))], [stats[i] for i in range(len(jobs))]


# Prompts of mixed lengths for batches (the longest crosses pages), with GREEDY's lengths.
BATCH_PROMPTS = [
    [5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200],
    [9],
    [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39,
     40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53],
    [100, 101, 102, 103, 104],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79],
]


class ByteTokens:
    """A tokenizer for engines built without files: ids are bytes, nothing ends a sequence."""

    eos_token_ids = frozenset()

    def decode(self, ids):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def alone(engine, prompt, params):
    return [e.token_id for e in engine.generate(prompt, params) if isinstance(e, Step)][:-1]


GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 14, 5, 11, 7)]


def three_in_a_nine_block_pool(engine):
    """Three requests that need 4 blocks each, their solo tokens, and a runtime whose pool
    holds 9 blocks: the pool runs dry as they grow."""
    from engines.runtime.kv import BlockPool

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    jobs = [(BATCH_PROMPTS[i], params) for i in (0, 3, 4)]
    expected = [alone(engine, p, params) for p, _ in jobs]
    engine.kv_pool = BlockPool(9, engine.kv_pool.block_size, engine.kv_pool.bytes_per_token)
    return jobs, expected, Runtime(engine, max_batch=3, max_prefill_tokens=64)
