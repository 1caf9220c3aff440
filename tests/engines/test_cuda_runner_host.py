"""The CUDA path's host logic on the CPU: CudaGraphRunner with a stand-in for CUDA graphs
(capture runs the step, replay runs it again into the captured output, as a graph would), and
the pipelined readback with plain tensors for pinned buffers. Positions, attention buckets,
capture bookkeeping and the read-back order must give transformers' tokens."""

import os

import pytest
import torch

from engines.base import SamplingParams
from engines.torch_engine import runner as runners
from engines.torch_engine.loader import load_model
from engines.torch_engine.sampling import make_sampler

PROMPT = [5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200]
CONTEXT = 64


class ReplayedGraphs:
    """Stands in for CudaGraphs: the same warm-up calls, and a replay that overwrites the
    captured output in place (callers hold on to that tensor, as with a real graph)."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def capture(self, step):
        for _ in range(3):
            step()
        out = step()
        self.captures += 1

        def replay():
            self.replays += 1
            out.copy_(step())

        return replay, out

    def synchronize(self):
        pass


class Event:
    """A CUDA event's contract, checked: the host waits only on an event recorded since its
    last wait, that is, after the copy into the buffer it guards was queued."""

    def __init__(self):
        self.recorded = False

    def record(self):
        self.recorded = True

    def synchronize(self):
        assert self.recorded, "waited on an event that guards no new copy"
        self.recorded = False


class HostReadback:
    def buffer(self):
        return torch.empty(1, dtype=torch.long)

    def event(self):
        return Event()


@pytest.fixture
def small_buckets(monkeypatch):
    # Attention buckets of 16, 32 and 64 slots: a generation to the end of the context crosses two.
    monkeypatch.setattr(runners, "MIN_DECODE_BUCKET", 16)


def graph_runner(path):
    model = load_model(path, torch.float32, "cpu")
    model.setup_cache(CONTEXT)
    graphs = ReplayedGraphs()
    # The step is traced whole by the compiler (backend "eager": no code generation), as on
    # CUDA, except under mutation testing, whose wrapped functions break the graph.
    backend = None if "MUTANT_UNDER_TEST" in os.environ else "eager"
    runner = runners.CudaGraphRunner(model, "cpu", tune=False, graphs=graphs, backend=backend)
    runner.warm_up(max_prompt=32)
    return runner, graphs


def reference_greedy(reference, prompt, n):
    seq = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = reference(seq).logits[0, -1].argmax().item()
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def test_captured_greedy_decode_to_the_end_of_the_context(tiny_dirs, small_buckets):
    path, reference = tiny_dirs["llama"]
    runner, graphs = graph_runner(path)
    assert sorted(runner._graphs) == [16, 32, 64] and graphs.captures == 3
    assert runner.compiled is True and runner.kernels is False  # no Triton kernels off CUDA
    assert runner._pos.item() != 0  # warm-up left it somewhere: the prefill must reset it
    replays_before = graphs.replays
    with torch.no_grad():
        first = runner.prefill(PROMPT).argmax().view(1)
        ids = list(runners.pipelined_ids(first, len(PROMPT), CONTEXT, runner.decode_greedy,
                                         HostReadback()))
    # One token per position from the prompt's end to the end of the context.
    assert len(ids) == CONTEXT - len(PROMPT) + 1
    assert ids == reference_greedy(reference, PROMPT, len(ids))
    # One replay a step, and no capture mid-way.
    assert graphs.captures == 3 and graphs.replays - replays_before == len(ids) - 1


def test_a_second_conversation_starts_clean(tiny_dirs, small_buckets):
    path, reference = tiny_dirs["qwen2"]
    runner, _ = graph_runner(path)
    for prompt in (PROMPT, PROMPT[3:8], [9] * 20):
        with torch.no_grad():
            first = runner.prefill(prompt).argmax().view(1)
            ids = list(runners.pipelined_ids(first, len(prompt), len(prompt) + 12,
                                             runner.decode_greedy, HostReadback()))
        assert ids == reference_greedy(reference, prompt, 13), prompt


def test_a_bucket_captured_mid_conversation_keeps_its_place(tiny_dirs, small_buckets):
    """A capture during a conversation (a bucket warm-up did not reach) runs warm-up steps
    that advance the position and overwrite the token buffer; both must come back."""
    path, reference = tiny_dirs["llama"]
    runner, graphs = graph_runner(path)
    runner._graphs.pop(32)
    with torch.no_grad():
        first = runner.prefill(PROMPT).argmax().view(1)
        ids = list(runners.pipelined_ids(first, len(PROMPT), 40, runner.decode_greedy,
                                         HostReadback()))
    assert graphs.captures == 4 and 32 in runner._graphs
    assert ids == reference_greedy(reference, PROMPT, len(ids))


def test_sampled_decode_through_graphs_equals_the_eager_runner(tiny_dirs, small_buckets):
    """Sampling hands the graph a token of its own each step (copied into the graph's input)."""
    path, _ = tiny_dirs["llama"]
    runner, _ = graph_runner(path)
    eager_model = load_model(path, torch.float32, "cpu")
    eager_model.setup_cache(CONTEXT)
    eager = runners.EagerRunner(eager_model, "cpu")
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=11)

    def run(r):
        sample = make_sampler(params, "cpu")
        with torch.no_grad():
            token = sample(r.prefill(PROMPT))
            return list(runners.pipelined_ids(
                token, len(PROMPT), 45, lambda t, p: sample(r.decode(t, p)), HostReadback()))

    assert run(runner) == run(eager)


def test_greedy_steps_hand_back_one_id(tiny_dirs, small_buckets):
    path, _ = tiny_dirs["llama"]
    runner, _ = graph_runner(path)
    eager_model = load_model(path, torch.float32, "cpu")
    eager_model.setup_cache(CONTEXT)
    for r in (runner, runners.EagerRunner(eager_model, "cpu")):
        with torch.no_grad():
            first = r.prefill(PROMPT).argmax().view(1)
            nxt = r.decode_greedy(first, len(PROMPT))
        assert nxt.shape == (1,) and nxt.dtype == torch.long, type(r).__name__


def test_pipelined_readback_reads_each_token_once_in_order():
    """The read-back alternates two buffers: step n+1 is queued before token n is read."""
    steps = []

    def step(token, pos):
        steps.append(pos)
        return torch.tensor([pos * 10])

    ids = list(runners.pipelined_ids(torch.tensor([7]), 5, 9, step, HostReadback()))
    assert ids == [7, 50, 60, 70, 80] and steps == [5, 6, 7, 8]
    assert list(runners.pipelined_ids(torch.tensor([3]), 9, 9, step, HostReadback())) == [3]
