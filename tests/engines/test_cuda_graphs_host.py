"""The CUDA graph decoder's host bookkeeping on the CPU: batch and attention buckets, the one
input buffer (tokens, positions, write slots, block tables, padding rows into the trash), with
a stand-in for CUDA graphs that re-runs the captured step into its captured outputs. Through it,
a batch whose rows join and leave gives each row its solo tokens."""

import sys
import threading
import time

import pytest
import torch

from engines.base import SamplingParams
from engines.runtime.plan import PENDING
from engines.runtime.runtime import Runtime
from engines.torch_engine import TorchEngine, cuda_graphs
from tests.engines.helpers import GatedGraphs, ReplayedGraphs, run_together
from tests.engines.helpers import BATCH_PROMPTS as PROMPTS
from tests.engines.helpers import GREEDY, alone, three_in_a_nine_block_pool


def test_buckets():
    assert cuda_graphs.batch_buckets(1) == [1]
    assert cuda_graphs.batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert cuda_graphs.attention_buckets(2048) == [256, 512, 1024, 2048]
    assert cuda_graphs.attention_buckets(96) == [96]
    assert cuda_graphs.attention_buckets(300) == [256, 300]
    assert cuda_graphs.smallest([1, 2, 4, 6], 3) == 4


@pytest.mark.parametrize("family", ["llama", "mistral_window"])
def test_graph_decoded_batches_give_each_row_its_solo_tokens(tiny_dirs, family, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)  # cross attention buckets early
    engine = TorchEngine(tiny_dirs[family][0], context_length=96, dtype="float32", device="cpu")
    expected = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    graphs = ReplayedGraphs()
    # Buckets 1, 2, 4 under a runtime of at most 3 rows: a step of 3 runs the graph of 4 with a
    # padding row, which must write into the trash slot (the pool's block 0 is the first
    # sequence's first block).
    engine.decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                              graphs=graphs)
    assert not engine.decoder.kernels  # Triton's kernels are for the GPU
    before = engine.kv.k[0].clone()
    engine.decoder.warm_up()
    # Capturing wrote nothing but the trash slot (compared as bits: unwritten slots may hold
    # NaN patterns).
    trash = engine.kv.trash
    assert torch.equal(before[:trash].view(torch.int32), engine.kv.k[0][:trash].view(torch.int32))
    assert set(engine.decoder._graphs) == {(b, n) for b in (1, 2, 4) for n in (16, 32, 64, 96)}
    buckets = set(engine.decoder._graphs)
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    got, _ = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
    assert got == expected
    # Every step replayed a graph captured at warm-up: none captured again, none for a batch
    # or length outside the buckets (the sampler's: a pair per batch bucket).
    assert set(engine.decoder._graphs) == buckets
    assert len(graphs.captured) == len(buckets) + 2 * 2 + 3 * 2  # and the scorer's
    # Seeded sampling through the graphs' logits: the same draws as alone.
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=30, seed=5, ignore_eos=True)
    engine_solo = alone(engine, PROMPTS[0], params)
    got, _ = run_together(runtime, [(PROMPTS[0], params), (PROMPTS[3], GREEDY[3])])
    assert got[0] == engine_solo


def test_the_compiled_step_is_two_graphs_for_every_bucket(tiny_dirs, monkeypatch):
    """Compiled (Dynamo, with a backend that records what it is given), the step is two graphs
    whatever the buckets: one for a batch of 1, one for every other batch and attention bucket.
    Each is traced and compiled again at every start: a third would cost each start its time.
    The sampler adds its two (probabilities, the draw), made as its graphs are captured at the
    warm-up."""
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    expected = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        engine.decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                                  graphs=ReplayedGraphs(), backend=record)
        engine.decoder.warm_up()
        assert len(engine.decoder._graphs) == 3 * 4
        assert len(graphs) == 2 + 2
        runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
        got, _ = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
        assert got == expected
    finally:
        torch._dynamo.reset()


def graph_engine(tiny_dirs, family="llama", max_batch=3, **options):
    engine = TorchEngine(tiny_dirs[family][0], context_length=96, dtype="float32", device="cpu",
                         **options)
    engine.decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=max_batch,
                                              graphs=ReplayedGraphs())
    return engine


def test_graphs_captured_beside_eager_steps_take_over_between_two_steps(tiny_dirs, monkeypatch):
    """The engine serves with eager steps while its graphs are captured on another thread; once
    they all are, the executor decodes through them and the runtime turns pipelined, between
    two steps of running requests, which still get exactly their solo tokens."""
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    solo = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    graphs = GatedGraphs()
    engine.decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                              graphs=graphs)
    engine.compiled = engine.decoder.warm_up_beside()
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    assert not runtime.pipelined and runtime.status().compiling
    decoded = []  # per step: how many rows the graphs decoded, and the runtime pipelined
    run = engine.decoder.run
    engine.decoder.run = lambda rows, last=None: (decoded.append(len(rows)), run(rows, last))[1]
    modes = []
    eager = []  # the eager decode steps' attention lengths and block-table widths
    forward = engine.model.forward_paged

    def forward_paged(batch, kv):
        if batch.tokens.shape[1] == 1 and batch.table is not None:
            eager.append((batch.kv_len, batch.table.shape[1]))
        return forward(batch, kv)

    engine.model.forward_paged = forward_paged

    def after_step():
        modes.append((runtime.pipelined, len(decoded)))
        if len(modes) == 4:  # mid-way: the graphs arrive
            graphs.gate.set()
            engine.compiled.result(timeout=60)
            assert not runtime.status().compiling

    got, stats = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9],
                              after_step=after_step)
    assert got == solo
    assert [s.completion_tokens for s in stats] == [g.max_tokens for g in GREEDY]
    assert modes[:4] == [(False, 0)] * 4  # eager: the graphs decoded nothing
    # Shaped as the graphs' batches: an attention bucket, that many pages of table.
    assert eager and all(n in engine.decoder.lengths and w == n // 16 for n, w in eager)
    assert modes[4] == (False, 1)  # the executor took the graphs at the next launch
    assert all(pipelined for pipelined, _ in modes[5:]) and modes[-1][1] > 5
    # Every graph was captured beside, none on demand since.
    assert len(engine.decoder._graphs) == 3 * 4
    assert engine.kv_pool.used_blocks == 0


def test_interim_graphs_serve_until_the_compiled_ones_arrive(tiny_dirs, monkeypatch):
    """Graphs of eager ops, captured first, serve while the compiled ones are made: the steps go
    eager, then through the interim graphs (pipelined), then through the compiled ones, each
    switch between two steps of running requests, which get exactly their solo tokens. The
    compiled capture starts only once the interim one has ended, and the engine lets the
    interim decoder go once the compiled one serves."""
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    solo = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    gated = {name: GatedGraphs() for name in ("interim", "compiled")}
    started = []  # the order the captures were asked for in (before their gates)

    def decoder(name):
        graphs = gated[name]
        capture = graphs.capture
        graphs.capture = lambda step: (started.append(name), capture(step))[1]
        return cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                        graphs=graphs)

    engine.interim, engine.decoder = decoder("interim"), decoder("compiled")
    first = engine.interim.warm_up_beside()
    engine.compiled = engine.decoder.warm_up_beside(after=first)
    engine.compiled.add_done_callback(engine._drop_interim)
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    decoded = {"interim": 0, "compiled": 0}
    for name, d in (("interim", engine.interim), ("compiled", engine.decoder)):
        run = d.run
        d.run = lambda rows, last=None, run=run, name=name: (
            decoded.__setitem__(name, decoded[name] + 1), run(rows, last))[1]
    modes = []

    def after_step():
        modes.append((runtime.pipelined, dict(decoded)))
        if len(modes) == 3:
            for _ in range(1000):
                if started:
                    break
                time.sleep(0.01)
            assert started == ["interim"]  # its first capture waits at the gate
            gated["interim"].gate.set()
            first.result(timeout=60)
        if len(modes) == 7:
            assert runtime.status().compiling
            gated["compiled"].gate.set()
            engine.compiled.result(timeout=60)

    got, _ = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9],
                          after_step=after_step)
    assert got == solo
    assert modes[:3] == [(False, {"interim": 0, "compiled": 0})] * 3
    assert modes[3] == (False, {"interim": 1, "compiled": 0})
    assert all(pipelined for pipelined, _ in modes[4:])
    assert modes[6][1]["compiled"] == 0 and modes[6][1]["interim"] == 4
    assert modes[7][1]["interim"] == 4 and modes[-1][1]["compiled"] > 3
    assert started.index("compiled") == len(gated["interim"].captured)
    assert engine.interim is None and not runtime.status().compiling
    assert engine.kv_pool.used_blocks == 0


def test_interim_graphs_serve_on_when_the_compiled_capture_fails(tiny_dirs, monkeypatch):
    """A compiled step whose capture fails (out of memory, say) leaves the interim graphs
    serving, not eager steps: requests get their solo tokens through them, the engine keeps the
    interim decoder, and the runtime's status names the failure."""

    class FailingGraphs(ReplayedGraphs):
        def capture(self, step):
            raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    solo = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    interim = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                       graphs=ReplayedGraphs())
    engine.decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                              graphs=FailingGraphs())
    engine.interim = interim
    first = interim.warm_up_beside()
    engine.compiled = engine.decoder.warm_up_beside(after=first)
    engine.compiled.add_done_callback(engine._drop_interim)
    assert isinstance(engine.compiled.exception(timeout=60), RuntimeError)
    decoded = []
    run = interim.run
    interim.run = lambda rows, last=None: (decoded.append(len(rows)), run(rows, last))[1]
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    got, _ = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
    assert got == solo
    assert decoded and runtime.pipelined and engine.interim is interim
    status = runtime.status()
    assert not status.compiling and "out of memory" in status.compile_error


def test_the_load_warms_up_eagerly_then_captures_beside(tiny_dirs, monkeypatch):
    """A one-device load runs its warm-up generation eagerly, then starts the capture and
    returns: the engine serves while it goes on, says it is compiling, and decodes through the
    graphs once they are all captured."""
    from engines.torch_engine import engine as engine_module

    graphs = GatedGraphs()
    made = []
    interval = sys.getswitchinterval()

    def make_decoder(model, kv, device, compile, max_batch, head=True, capture=True):
        made.append(capture)
        return cuda_graphs.GraphDecoder(model, kv, device, max_batch, graphs=graphs)

    monkeypatch.setattr(engine_module, "make_decoder", make_decoder)
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32",
                         device="cpu", max_batch=4)
    assert made == [False] and graphs.captured == []  # the warm-up ran without graphs
    assert not engine.compiled.done() and engine.decoder.capturing is engine.compiled
    # The GIL changes hands often while the capture runs beside the serving thread.
    assert sys.getswitchinterval() == pytest.approx(cuda_graphs.CAPTURE_SWITCH_INTERVAL_S,
                                                    abs=2e-6)
    decoded = []
    run = engine.decoder.run
    engine.decoder.run = lambda rows, last=None: (decoded.append(len(rows)), run(rows, last))[1]
    eager = alone(engine, PROMPTS[0], GREEDY[0])
    assert decoded == []
    graphs.gate.set()
    engine.wait_compiled()
    assert engine.compiled.done() and engine.compiled.exception() is None
    assert sys.getswitchinterval() == pytest.approx(interval, abs=2e-6)
    assert alone(engine, PROMPTS[0], GREEDY[0]) == eager and decoded
    engine.close()


def test_a_compiled_load_asked_for_interim_graphs_captures_them_first(tiny_dirs, monkeypatch):
    """When the decode step is compiled the load by default also makes a decoder of eager ops
    (compile off), whose graphs are captured beside first; the compiled capture follows it.
    close() abandons both captures and waits for them (the compiled one never began).
    DUET_INTERIM_GRAPHS=0: no interim."""
    from engines.torch_engine import engine as engine_module

    made = []

    def make_decoder(model, kv, device, compile, max_batch, head=True, capture=True):
        made.append((compile, capture))
        decoder = cuda_graphs.GraphDecoder(model, kv, device, max_batch, graphs=GatedGraphs())
        decoder.compiled = compile != "off"
        return decoder

    monkeypatch.setattr(engine_module, "make_decoder", make_decoder)
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    monkeypatch.setenv("DUET_INTERIM_GRAPHS", "0")
    plain = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32",
                        device="cpu", max_batch=4, compile="on")
    assert made == [("on", False)] and plain.interim is None
    plain.decoder.graphs.gate.set()
    plain.close()
    made.clear()
    monkeypatch.delenv("DUET_INTERIM_GRAPHS")
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32",
                         device="cpu", max_batch=4, compile="on")
    assert made == [("on", False), ("off", False)]
    interim, compiled = engine.interim, engine.decoder
    assert not interim.compiled and compiled.compiled
    assert interim.capturing is not None and engine.compiled is compiled.capturing
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert interim._abandoned.wait(10)
    assert closer.is_alive()  # waiting for the interim capture under way
    interim.graphs.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    for decoder in (interim, compiled):
        assert isinstance(decoder.capturing.exception(timeout=0), cuda_graphs.CaptureAbandoned)
    assert len(interim.graphs.captured) == 1 and compiled.graphs.captured == []
    assert engine.decoder is None and engine.interim is None


def test_a_closing_engine_abandons_its_capture_and_waits_for_it(tiny_dirs):
    """close() stops the capture between two graphs and returns once its thread has let go of
    the model and the pool; the engine never took graphs, and a capture that fails leaves the
    steps eager."""
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    graphs = GatedGraphs()
    engine.decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                              graphs=graphs)
    decoder = engine.decoder
    engine.compiled = decoder.warm_up_beside()
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert decoder._abandoned.wait(10)
    assert closer.is_alive()  # waiting for the capture under way
    graphs.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    with pytest.raises(cuda_graphs.CaptureAbandoned):
        engine.compiled.result(timeout=0)
    assert len(graphs.captured) == 1  # the one under way, then no more

    failing = graph_engine(tiny_dirs)
    failing.decoder._fn = lambda *a: (_ for _ in ()).throw(RuntimeError("no room"))
    failing.compiled = failing.decoder.warm_up_beside()
    with pytest.raises(RuntimeError, match="no room"):
        failing.compiled.result(timeout=30)
    runtime = Runtime(failing, max_batch=3, max_prefill_tokens=64)
    assert runtime.status().compile_error == "RuntimeError: no room"
    got, _ = run_together(runtime, [(PROMPTS[0], GREEDY[0])])
    assert not runtime.pipelined and failing.decoder.graphs.captured == []
    assert got[0] == alone(failing, PROMPTS[0], GREEDY[0])


def test_pipelined_steps_feed_the_last_pick_from_the_device(tiny_dirs, monkeypatch):
    """With graphs, step N+1 is launched before step N is read: its decode rows carry PENDING
    and take their token from step N's picks. Each request still gets exactly its solo tokens,
    max_tokens of them, and every block comes back."""
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = graph_engine(tiny_dirs)
    solo = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    assert runtime.pipelined
    fed = []
    run = engine.decoder.run
    engine.decoder.run = lambda rows, last=None: (fed.extend(r.tokens[0] for r in rows),
                                                  run(rows, last))[1]
    got, stats = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
    assert got == solo
    assert [s.completion_tokens for s in stats] == [g.max_tokens for g in GREEDY]
    assert fed.count(PENDING) > len(fed) // 2  # most decode rows ran before their token was read
    assert engine.kv_pool.used_blocks == 0


def test_pipelined_preemption_and_abort(tiny_dirs, monkeypatch):
    """A pool too small for three: the newest is preempted while a token of it is in flight,
    comes back with that token and still gets its solo tokens; a request stopped mid-way frees
    its blocks and the others go on."""
    from engines.runtime.runtime import Submission

    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = graph_engine(tiny_dirs)
    jobs, solo, runtime = three_in_a_nine_block_pool(engine)
    params = jobs[0][1]
    preempted = []
    preempt = runtime.scheduler._preempt
    runtime.scheduler._preempt = lambda seq: (preempted.append(seq.inflight), preempt(seq))
    got, _ = run_together(runtime, jobs)
    assert got == solo
    assert preempted and max(preempted) == 1  # preempted with a token in flight
    assert engine.kv_pool.used_blocks == 0

    stop = [False]
    events = []
    runtime.add(Submission(list(PROMPTS[0]), params, events.append, lambda: stop[0]))
    for _ in range(5):
        runtime.step()
    stop[0] = True
    while runtime.has_work:
        runtime.step()
    assert events[-1].finish_reason == "cancelled"
    assert 0 < events[-1].completion_tokens < 40
    assert engine.kv_pool.used_blocks == 0


def test_pipelined_rows_with_processing_run_every_step_and_get_their_solo_tokens(
        tiny_dirs, monkeypatch):
    """Penalties (counts kept on the device) and a grammar (its last token read from the step
    that sampled it) are applied to rows whose token is still in flight: those rows run every
    step, not every other, and each request gets what it gets alone on the plain engine. A
    step with a grammar is drawn late, once its masks are made beside the runtime's work."""
    from engines.grammar import json_schema_grammar

    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "c"]},
                                               "n": {"type": "integer"}},
              "required": ["k", "n"], "additionalProperties": False}
    jobs = [
        (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                    presence_penalty=1.0, frequency_penalty=0.5,
                                    repetition_penalty=1.3, logit_bias=((7, 3.0),))),
        (PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0,
                                    grammar=json_schema_grammar(schema))),
        (PROMPTS[3], GREEDY[3]),
    ]
    plain = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    solo = [alone(plain, p, g) for p, g in jobs]
    engine = graph_engine(tiny_dirs)
    fed = []
    run = engine.decoder.run
    engine.decoder.run = lambda rows, last=None: (
        fed.extend(r.tokens[0] == PENDING for r in rows if r.sampling.processing is not None),
        run(rows, last))[1]
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    deferred = []  # whether each launched step's draw waited for its masks
    launch = runtime.executor.launch
    runtime.executor.launch = lambda plan: (launch(plan), deferred.append(
        runtime.executor._deferred is not None))[0]
    got, _ = run_together(runtime, jobs)
    assert got == solo
    assert len(fed) >= 12 + len(got[1]) - 4 and sum(fed) > len(fed) * 3 // 4
    # The grammar's masks were computed on the worker while the runtime went on, its steps
    # drawn at the next launch (or their collect).
    assert sum(deferred) >= len(got[1]) - 2
    assert engine.kv_pool.used_blocks == 0


def test_the_sampler_graphs_draw_what_the_sampler_does(monkeypatch):
    """Replayed as graphs (a bucket per batch size from 2, ranked or not), the sampler draws
    for each row what the eager sampler draws: padding rows and a smaller batch after a
    larger one (stale inputs left in the buffers) change nothing; beyond the largest bucket
    it draws directly. It never reads the device, which a graph's capture forbids."""
    from engines.torch_engine import sampling

    vocab = 300
    direct = sampling.Sampler()  # the eager one, reading the device where it helps

    def refused(*args):
        raise AssertionError("a host read in a graph")

    monkeypatch.setattr(sampling, "nucleus_eager", refused)
    monkeypatch.setattr(sampling, "race_among", refused)
    graphs = cuda_graphs.GraphSampler(None, ReplayedGraphs(), max_batch=8, vocab=vocab,
                                      device="cpu")
    assert graphs.buckets == [2, 4, 8]
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():  # as the executor draws
        for n, ranked in ((5, 0), (3, vocab), (1, 0), (8, 40), (1, vocab), (9, vocab)):
            logits = torch.randn(n, vocab, generator=gen) * 3
            # Ranked by 40: top_k 7 on even rows, with top_p; by the vocabulary: top_p alone.
            topk = [7 if ranked == 40 and i % 2 == 0 else vocab for i in range(n)]
            floats = torch.tensor([[0.5 + 0.2 * i, -6.0 if i % 3 else -float("inf"),
                                    0.8 if (ranked == vocab) == bool(i % 2) else 1.0]
                                   for i in range(n)])
            ints = torch.tensor([[17 * i, i, topk[i]] for i in range(n)])
            got = graphs(logits, floats, ints, ranked)
            assert got.tolist() == direct(logits, floats, ints, ranked).tolist()
    assert set(graphs._graphs) == {(2, False), (2, True), (4, True), (8, False), (8, True)}


def test_the_scorer_graphs_score_what_the_scores_table_does():
    """Replayed as graphs (a bucket per batch size, one per bucket of alternatives), token
    log-probabilities are the eager table's: padding rows and stale inputs change nothing, a
    row of k alternatives finds them first in a wider bucket, and a batch beyond the largest
    bucket is scored directly."""
    from engines.torch_engine import sampling

    vocab = 300
    graphs = cuda_graphs.GraphScorer(ReplayedGraphs(), max_batch=8, vocab=vocab, device="cpu")
    assert graphs.buckets == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for n, k in ((5, 3), (8, 20), (1, 1), (3, 5), (9, 2), (2, 21)):
            logits = torch.randn(n, vocab, generator=gen) * 3
            tokens = torch.randint(vocab, (n,), generator=gen)
            want = sampling.scores_table(logits, tokens, k)
            got = graphs(logits, tokens, k)
            wide = (got.shape[1] - 1) // 2
            assert got.shape[0] == n and wide >= k
            torch.testing.assert_close(got[:, : 1 + k], want[:, : 1 + k])
            torch.testing.assert_close(got[:, 1 + wide: 1 + wide + k], want[:, 1 + k:])
            keys = list(range(n))
            assert (sampling.ScoredRows(keys, got, [k] * n).read()
                    == sampling.ScoredRows(keys, want, [k] * n).read())
    assert set(graphs._graphs) == {(8, 5), (8, 20), (1, 5), (4, 5)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_scorer_captured_on_cuda_scores_as_the_table_does():
    """Real CUDA graphs: torch.topk and the rest capture without a host read, and replay the
    eager table's scores over a 49k vocabulary (float32 logits: bfloat16's ties could be
    ranked either way)."""
    from engines.torch_engine import sampling

    vocab = 49152
    scorer = cuda_graphs.GraphScorer(cuda_graphs.CudaGraphs(), 64, vocab, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.inference_mode():
        scorer.warm_up()
        for n, k in ((64, 5), (3, 20), (17, 1)):
            logits = torch.randn(n, vocab, device="cuda", generator=gen) * 4
            tokens = torch.randint(vocab, (n,), device="cuda", generator=gen)
            got, want = scorer(logits, tokens, k), sampling.scores_table(logits, tokens, k)
            wide = (got.shape[1] - 1) // 2
            torch.testing.assert_close(got[:, : 1 + k], want[:, : 1 + k])
            torch.testing.assert_close(got[:, 1 + wide: 1 + wide + k], want[:, 1 + k:])


def test_a_split_vocabulary_projection_decodes_as_the_whole(tiny_dirs):
    """Under tensor parallelism the decode step projects the vocabulary through the model's
    VocabSplit (each rank its rows, rank 0 gathering). Here one rank's split over the whole
    vocabulary with a gather that passes its part on: the rows still get their solo tokens,
    and every step went through it."""
    from engines.torch_engine.loader import load_model
    from engines.torch_engine.tensor_parallel import VocabSplit

    engine = graph_engine(tiny_dirs, max_batch=4)
    # The projection's float weight (the engine's own is packed for oneDNN on this CPU).
    weight = load_model(tiny_dirs["llama"][0], torch.float32, "cpu").lm_head.weight
    expected = [alone(engine, p, g) for p, g in zip(PROMPTS, GREEDY)]
    gathered = []

    def gather(part):
        gathered.append(part.shape[0])
        return part

    engine.model.vocab_split = VocabSplit(weight, gather)
    engine.decoder.warm_up()
    gathered.clear()
    runtime = Runtime(engine, max_batch=3, max_prefill_tokens=64)
    got, _ = run_together(runtime, list(zip(PROMPTS, GREEDY)), join_at=[0, 0, 2, 3, 9])
    assert got == expected
    assert gathered, "the decode steps did not project through the split"


def test_the_attention_kernels_are_compiled_before_serving_writing_only_the_trash(
        tiny_dirs, monkeypatch):
    """compile_kernels runs one one-row eager decode step per attention bucket (where Triton
    compiles the kernel of that bucket's slices on a GPU), each step writing only the pool's
    trash slot; a decoder without the kernels does nothing."""
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32", device="cpu")
    decoder = cuda_graphs.GraphDecoder(engine.model, engine.kv, "cpu", max_batch=4,
                                       graphs=ReplayedGraphs())
    seen = []
    forward = engine.model.forward_paged
    engine.model.forward_paged = lambda batch, kv: (seen.append(batch), forward(batch, kv))[1]
    decoder.compile_kernels()
    assert seen == []  # on the CPU there are no kernels to compile
    decoder.kernels = True  # as on a GPU (the model's attention stays the CPU's own)
    before = [t.clone() for t in engine.kv.k + engine.kv.v]
    decoder.compile_kernels()
    assert [(b.kv_len, b.table.shape[1]) for b in seen] == [(16, 1), (32, 2), (64, 4), (96, 6)]
    assert all(b.write_slots.tolist() == [engine.kv.trash] for b in seen)
    trash = engine.kv.trash
    for old, new in zip(before, engine.kv.k + engine.kv.v):
        assert torch.equal(old[:trash].view(torch.int32), new[:trash].view(torch.int32))
    engine.close()


class _FakeCuda:
    """torch.cuda's streams and graphs as CudaGraphs.capture uses them, on the CPU: each
    thread's current stream, and for every run of a step the stream it ran on and whether a
    capture was under way there."""

    def __init__(self):
        self.made, self.runs, self._local = [], [], threading.local()
        self.default = self.Stream()
        self.made.clear()
        fake = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                fake.capturing = fake.current_stream()

            def capture_end(self):
                fake.capturing = None

            def pool(self):
                return "pool"

            def replay(self):
                pass

        self.CUDAGraph, self.capturing = Graph, None

    def Stream(self):
        stream = type("FakeStream", (), {"wait_stream": lambda self, other: None})()
        self.made.append(stream)
        return stream

    def current_stream(self):
        return getattr(self._local, "stack", [self.default])[-1]

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def within():
            self._local.stack = [*getattr(self._local, "stack", [self.default]), s]
            try:
                yield
            finally:
                self._local.stack.pop()
        return within()

    def graph(self, g, pool=None, stream=None):
        import contextlib

        @contextlib.contextmanager
        def capturing():
            with self.stream(stream):
                g.capture_begin(pool)
                try:
                    yield
                finally:
                    g.capture_end()
        return capturing()

    def step(self):
        self.runs.append((self.current_stream(), self.capturing is not None))
        return ()


@pytest.mark.parametrize("beside", [False, True])
def test_captures_share_one_stream_that_runs_no_warm_up(monkeypatch, beside):
    """A captured GEMM keeps the cuBLAS workspace of its thread's handle and its stream: a
    warm-up (or Inductor's tuning) on a stream that graphs were captured on races those graphs'
    replays on that workspace (a GPU that spun for ever on a first start). Every capture of a
    CudaGraphs is on one stream, its warm-ups on another, and no capture takes a new stream."""
    fake = _FakeCuda()
    for name in ("Stream", "current_stream", "stream", "graph", "CUDAGraph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    graphs = cuda_graphs.CudaGraphs()
    graphs.beside = beside

    def capture_on_a_thread():
        with fake.stream(fake.Stream()):  # warm_up_beside's thread has a stream of its own
            for _ in range(3):
                graphs.capture(fake.step)

    if beside:
        thread = threading.Thread(target=capture_on_a_thread)
        thread.start()
        thread.join()
    else:
        for _ in range(3):
            graphs.capture(fake.step)
    captured = {id(s) for s, capturing in fake.runs if capturing}
    warmed = {id(s) for s, capturing in fake.runs if not capturing}
    assert len([r for r in fake.runs if r[1]]) == 3 and len(fake.runs) == 12
    assert len(captured) == 1 and len(warmed) == 1 and not captured & warmed
    assert id(fake.default) not in captured | warmed
    assert len(fake.made) == 2 + beside  # the two streams, once (and the thread's own)
