"""A forward through the torch engine's modules on one thread while torch.fx traces on another
(torch.compile beside the served steps): the tracer patches every module's __call__ for the
whole process while it traces, so the forward waits for the trace to end (trace_guard)."""

import threading

import numpy as np
import pytest
import torch

from engines.base import SamplingParams
from engines.runtime.runtime import Runtime
from engines.torch_engine import TorchEngine, trace_guard
from tests.engines.helpers import run_together


class Tracing:
    """torch.fx.symbolic_trace of a module whose forward waits, on a thread: while it waits,
    the tracer's patches are in place."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()
        tracing = self

        class Slow(torch.nn.Module):
            def forward(self, x):
                tracing.inside.set()
                assert tracing.release.wait(30)
                return x + 1

        self.thread = threading.Thread(target=torch.fx.symbolic_trace, args=(Slow(),),
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        assert self.inside.wait(30)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(30)


def in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("got", fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_module_called_during_a_trace_elsewhere_fails_unguarded():
    """Why the guard exists: torch.fx's tracer sends another thread's module calls through
    itself (if this stops failing, a torch release changed the tracer)."""
    with Tracing():
        with pytest.raises(NameError, match="not installed as a submodule"):
            torch.nn.Linear(2, 2)(torch.ones(1, 2))


def test_the_engines_forwards_wait_for_a_trace_on_another_thread(tiny_dirs):
    assert trace_guard.install() and trace_guard.install()  # once, however often asked
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    want = engine.logits([5, 6, 7])
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    solo, _ = run_together(Runtime(engine, max_batch=2, max_prefill_tokens=64),
                           [([5, 6, 7], greedy)])
    with Tracing() as tracing:
        scoring, scored = in_thread(lambda: engine.logits([5, 6, 7]))
        stepping, stepped = in_thread(lambda: run_together(
            Runtime(engine, max_batch=2, max_prefill_tokens=64), [([5, 6, 7], greedy)])[0])
        scoring.join(0.5)
        stepping.join(0.5)
        assert scoring.is_alive() and stepping.is_alive()  # both wait for the trace's end
        tracing.release.set()
    scoring.join(30)
    stepping.join(30)
    assert np.array_equal(scored["got"], want)
    assert stepped["got"] == solo
