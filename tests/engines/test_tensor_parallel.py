"""Tensor parallelism on the CPU (gloo, 2 ranks, tiny checkpoints in float32): the split model
gives the tokens and scores of the whole one, a rank reads only its slices, and a rank that dies
mid-batch ends the batch's requests with an error instead of a hang."""

import asyncio
import gc
import os
import re
import signal
import time
from functools import partial

import psutil
import pytest
import torch

from engines.base import RequestStats, SamplingParams, Step, UnsupportedModel
from engines.runtime.process import EngineProcessError
from engines.torch_engine import TorchEngine
from engines.torch_engine.config import ModelArgs
from engines.torch_engine.loader import load_model, read_config
from engines.torch_engine.tensor_parallel import Shard, Sums, check_splits, read_shard
from server.worker import EngineWorker
from tests.engines.helpers import run_batch

# Mixed: a long prompt prefilled in chunks (max_prefill_tokens 64), short ones joining while it
# decodes, and a seeded sampled row.
PROMPTS = [list(range(3, 103)), [9, 8], [100, 101, 102, 103, 104], [50, 60, 70]]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 3 + [
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]


def engine(path, ranks):
    return TorchEngine(path, context_length=256, dtype="float32", device="cpu",
                       tensor_parallel=ranks)


def tokens(steps):
    return [[s.token_id for s in row] for row in steps]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_window", "smollm"])
def test_two_ranks_give_the_tokens_and_scores_of_one(tiny_dirs, family):
    """qwen2: Q/K/V biases split with their rows; mistral_window: the sliding window's mask on
    each rank's heads; smollm: tied embeddings, whole on every rank."""
    path = tiny_dirs[family][0]
    one, two = engine(path, 1), engine(path, 2)
    try:
        assert two.info.extra["tensor_parallel"] == "2"
        assert two.info.devices == 1  # the CPU's ranks share its memory
        assert two.info.weights_bytes > one.info.weights_bytes  # the whole ones twice
        assert two.kv.k[0].shape[1] == one.kv.k[0].shape[1] // 2  # its KV heads only
        expected = run_batch(one, PARAMS, [0, 1, 3, 4], PROMPTS)
        got = run_batch(two, PARAMS, [0, 1, 3, 4], PROMPTS)
        assert tokens(got) == tokens(expected)
        # Forwards outside the steps (scoring, whole-prompt logits) are run by every rank too.
        torch.testing.assert_close(torch.from_numpy(two.logits(PROMPTS[0])),
                                   torch.from_numpy(one.logits(PROMPTS[0])), atol=1e-4, rtol=1e-4)
        scores = [two.score_continuations([PROMPTS[2]], [[5, 6], [7]]) for _ in range(2)]
        reference = one.score_continuations([PROMPTS[2]], [[5, 6], [7]])
        for s in scores:
            for got_row, want_row in zip(s.token_logprobs[0], reference.token_logprobs[0]):
                assert got_row == pytest.approx(want_row, abs=1e-4)
        # ... and the steps after them still pair up.
        assert tokens(run_batch(two, PARAMS[:1], [0], PROMPTS[1:2])) == tokens(expected[1:2])
    finally:
        two.close()


def test_each_rank_quantizes_its_share(tiny_dirs):
    """int8 weights: each rank quantizes the slices it holds (a row-wise split's scales are
    taken over its half of the inputs, so the logits differ a little from one rank's)."""
    path = tiny_dirs["llama"][0]
    one = TorchEngine(path, context_length=64, dtype="float32", device="cpu", quantize="int8")
    two = TorchEngine(path, context_length=64, dtype="float32", device="cpu", quantize="int8",
                      tensor_parallel=2)
    try:
        assert two.info.quantization == one.info.quantization != "none"
        diff = abs(two.logits(PROMPTS[2]) - one.logits(PROMPTS[2])).max()
        assert diff < 0.1
    finally:
        two.close()


def test_a_rank_reads_its_slices_and_the_slices_make_the_whole(tiny_dirs):
    from safetensors.torch import load_file

    path = tiny_dirs["qwen2"][0]
    args = ModelArgs.from_hf(read_config(path))
    files = sorted(path.glob("*.safetensors"))
    whole = {k: v for f in files for k, v in load_file(f).items()}
    parts = [read_shard(files, args, Shard(r, 2), args.tie_word_embeddings) for r in range(2)]
    name = "model.layers.1.{}"
    for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                   "mlp.up_proj"):  # by output rows, biases with them
        for kind in ("weight", "bias"):
            key = name.format(f"{module}.{kind}")
            if key in whole:
                assert parts[0][key].shape[0] == whole[key].shape[0] // 2
                torch.testing.assert_close(torch.cat([p[key] for p in parts]), whole[key])
    for module in ("self_attn.o_proj", "mlp.down_proj"):  # by input columns
        key = name.format(f"{module}.weight")
        torch.testing.assert_close(torch.cat([p[key] for p in parts], dim=1), whole[key])
    for key in ("model.embed_tokens.weight", "model.norm.weight"):  # whole on each rank
        assert all(torch.equal(p[key], whole[key]) for p in parts)
    assert "lm_head.weight" not in parts[0]  # tied: the embedding stands for it


class RecordedPeerSums:
    """Stands in for peer_sum.PeerSum: records each sum's phase and rows, adds nothing (one
    rank)."""

    def __init__(self, capacity: int):
        self.capacity, self.calls = capacity, []

    def fits(self, x):
        return x.numel() <= self.capacity

    def __call__(self, x, phase):
        self.calls.append((phase, x.numel() // x.shape[-1]))
        return x

    def add_norm(self, x, residual, weight, eps, phase):
        """peer_sum_norm's arithmetic, one rank's."""
        self.calls.append((f"norm {phase}", x.numel() // x.shape[-1]))
        new = residual + x
        return new, torch.nn.functional.rms_norm(new, (new.shape[-1],), weight, eps)


def test_a_forward_sums_twice_a_layer_in_alternating_phases(tiny_dirs):
    """What the peer sums' buffers rely on (peer_sum.py): every forward sums each layer's
    attention through phase 0, then its MLP through phase 1, so consecutive sums never share a
    buffer, whatever forwards follow one another; a sum larger than the buffers goes through
    the group's all-reduce; the sums' results are what the layers go on with."""
    import torch.distributed as dist

    path = tiny_dirs["llama"][0]
    model = load_model(path, torch.float32, "cpu")
    whole = load_model(path, torch.float32, "cpu")
    model.setup_rope(32)
    whole.setup_rope(32)
    hidden, layers = model.args.hidden_size, model.args.num_layers
    peer = RecordedPeerSums(capacity=3 * hidden)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model.sums = Sums(dist.group.WORLD, peer)
        for layer in model.model.layers:
            layer.sums = model.sums
        with torch.inference_mode():
            for tokens in ([[5, 6]], [[5, 6, 7, 8, 9]], [[7]]):  # 2 rows fit, 5 do not
                x = torch.tensor(tokens)
                with model.scratch_cache(16), whole.scratch_cache(16):
                    assert torch.allclose(model(x, 0), whole(x, 0), atol=1e-5)
    finally:
        dist.destroy_process_group()
    assert peer.calls == [(0, 2), (1, 2)] * layers + [(0, 1), (1, 1)] * layers


def test_sums_fused_with_their_norms_decode_as_unfused(tiny_dirs):
    """With fused norms (DUET_TP_FUSED_NORMS=1: each sum, its residual add and the next norm in
    one kernel, peer_sum_norm), a model takes its blocks' norms from Sums.add_norm for the
    forwards the peer sums hold, in phases 0 then 1 a layer, and decodes what it decodes
    unfused; a prefill chunk larger than the peer sums goes unfused."""
    import torch.distributed as dist

    path = tiny_dirs["llama"][0]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2
    prompts = [PROMPTS[0][:40], PROMPTS[1]]
    plain = engine(path, 1)
    want = tokens(run_batch(plain, params, [0, 1], prompts))
    fused = engine(path, 1)
    layers = fused.model.args.num_layers
    peer = RecordedPeerSums(capacity=8 * fused.model.args.hidden_size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fused.model.sums = Sums(dist.group.WORLD, peer, fused_norms=True)
        for layer in fused.model.model.layers:
            layer.sums = fused.model.sums
        got = tokens(run_batch(fused, params, [0, 1], prompts))
    finally:
        dist.destroy_process_group()
    assert got == want
    norms = [c for c in peer.calls if str(c[0]).startswith("norm")]
    assert len(norms) >= 2 * layers and all(rows <= 8 for _, rows in peer.calls)
    phases = [c[0] for c in norms]
    assert phases == ["norm 0", "norm 1"] * (len(phases) // 2)
    # The 40-token prompt's prefill is larger than 8 rows: summed by the group, unfused.
    assert not any(rows == 40 for _, rows in peer.calls)


def test_a_step_failing_on_rank_0_alone_stops_the_engine(tiny_dirs, monkeypatch):
    """A step that fails on rank 0 after the other ranks were told it leaves them in its
    collectives, out of step with rank 0 (whose next step's sums would meet this one's): the
    request ends with an engine-process error and the engine stops (on_lost: by default its
    process exits and the server loads the model anew) instead of going on out of step."""
    from engines.runtime.runtime import Runtime, Submission

    eng = engine(tiny_dirs["llama"][0], 2)
    stopped, events = [], []
    eng.ranks.on_lost = stopped.append
    forward, calls = eng.model.forward_paged, []

    def failing(batch, kv):
        calls.append(1)
        if len(calls) == 3:  # a decode step, the ranks told it
            raise RuntimeError("injected")
        return forward(batch, kv)

    monkeypatch.setattr(eng.model, "forward_paged", failing)
    try:
        runtime = Runtime(eng, max_batch=2, threaded_output=False)
        runtime.add(Submission([5, 6, 7], PARAMS[0], events.append))
        while runtime.has_work:
            runtime.step()
    finally:
        for pid in eng.ranks.pids:  # rank 1 waits in the failed step's collective
            os.kill(pid, signal.SIGKILL)
        eng.close()
    assert len(calls) == 3 and isinstance(events[-1], EngineProcessError), events[-1]
    assert "out of step" in str(events[-1]) and "out of step" in stopped[0]


def test_a_rank_traces_its_first_steps_when_asked(tiny_dirs, monkeypatch, tmp_path):
    """DUET_RANK_TRACE (profile_step.py --trace sets it): rank 1 writes a Chrome trace of its
    first StepTrace.STEPS steps, its forwards in it, and goes on serving."""
    import json

    from engines.torch_engine.rank_worker import StepTrace

    monkeypatch.setenv("DUET_RANK_TRACE", str(tmp_path / "trace"))
    two = engine(tiny_dirs["llama"][0], 2)
    try:
        params = [SamplingParams(max_tokens=StepTrace.STEPS + 4, temperature=0.0,
                                 ignore_eos=True)]
        got = run_batch(two, params, [0], [PROMPTS[1]])
        assert len(got[0]) == StepTrace.STEPS + 4
        path = tmp_path / "trace.rank1.json"
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        # The forwards' norms (on the CPU layer norms: cpu_norm) and the ranks' sums.
        assert "aten::native_layer_norm" in names and any("allreduce" in str(n) for n in names)
        assert not (tmp_path / "trace.rank0.json").exists()  # rank 0 is the caller's to trace
    finally:
        two.close()


def test_a_rank_keeps_what_it_loaded_out_of_garbage_collections(tiny_dirs, monkeypatch, capfd):
    """A rank's process settles its load (gc_pauses.settle) once it is built: a collection that
    walked its shard and graphs mid-step would hold every rank at the next sum. Its log says
    so (the suite runs with DUET_GC_FREEZE=0; the rank's own process freezes here)."""
    monkeypatch.setenv("DUET_GC_FREEZE", "1")
    two = engine(tiny_dirs["llama"][0], 2)
    try:
        got = run_batch(two, [PARAMS[0]], [0], [PROMPTS[1]])
        assert len(got[0]) == 12
    finally:
        two.close()
    assert re.search(r"tensor-parallel rank 1: \d+ objects kept out of garbage collections",
                     capfd.readouterr().err)
    assert gc.get_freeze_count() == 0  # rank 0 is this test's process: left as it was


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_the_peer_shares_check_fits_any_batch(rows):
    """create_share checks the share at load with known ids: each fits a batch of `rows` (a
    check of 3 ids once failed every load with --max-batch 1 or 2), and the last is a full
    batch with ids past 2**16."""
    from engines.torch_engine.peer_sum import known_shares

    shares = known_shares(rows)
    assert all(0 < len(s) <= rows for s in shares) and len(shares[-1]) == rows
    assert all((s >= 0).all() for s in shares)
    if rows > 2:
        assert shares[-1].max() >= 2 ** 16


def test_a_model_that_does_not_split_is_refused_in_one_sentence(tiny_dirs):
    args = ModelArgs.from_hf(read_config(tiny_dirs["llama"][0]))  # 4 heads, 2 KV heads
    check_splits(args, 2)
    with pytest.raises(UnsupportedModel, match="KV heads \\(2\\) to divide by 4"):
        check_splits(args, 4)


@pytest.mark.parametrize("visible, expect", [
    (None, ["1", "2"]), ("4,5,6", ["5", "6"]), ("GPU-a, GPU-b,GPU-c", ["GPU-b", "GPU-c"])])
def test_each_cuda_rank_sees_its_own_gpu_alone_as_device_0(visible, expect):
    from engines.torch_engine.ranks import OVERLAPPING_DEVICES, rank_device, rank_environment

    base = {"PATH": "/bin"} | ({"CUDA_VISIBLE_DEVICES": visible} if visible else {})
    envs = [rank_environment(base, "cuda", rank) for rank in (1, 2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == expect
    assert all(e[OVERLAPPING_DEVICES] == "1" and e["PATH"] == "/bin" for e in envs)
    assert rank_device("cuda") == "cuda:0"  # so every rank's kernels name the same device
    assert rank_environment(base, "cpu", 1) == base and rank_device("cpu") == "cpu"
    if visible == "4,5,6":
        with pytest.raises(ValueError, match="rank 3 has no GPU"):
            rank_environment(base, "cuda", 3)


@pytest.mark.parametrize("n", [1, 7, 1024, 1025, 256 * 1024, 256 * 1024 + 1, 700_000,
                               2 * 256 * 2048, 2048 * 4096, 64 * 64_128])
@pytest.mark.parametrize("most", [256, 264, 116])
def test_a_peer_sum_is_laid_out_for_latency_small_and_bandwidth_large(n, most):
    from engines.torch_engine import peer_sum as ps

    programs, block, warps = ps.layout(n, most)
    assert 1 <= programs <= most  # all resident: each waits on its peers' namesake
    assert ps.BLOCK <= block <= ps.MAX_BLOCK and block & (block - 1) == 0
    assert programs * block >= min(n, most * block)  # every element has a program
    if n <= most * ps.BLOCK:  # a decode step's: the smallest block, a program each
        assert (block, programs) == (ps.BLOCK, -(-n // ps.BLOCK))
    else:  # every program busy, each with two blocks or more, the largest such block
        assert programs == most
        assert block == ps.BLOCK or 2 * block * programs <= n
        assert block == ps.MAX_BLOCK or n < 4 * block * programs
    assert warps * 32 * 4 <= block <= warps * 32 * 16  # a thread's loads 8-32 bytes wide


def _rank_processes(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if any("rank_worker" in part for part in p.cmdline())]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_a_rank_killed_mid_batch_ends_its_requests_with_an_error(tiny_dirs):
    worker = EngineWorker("tp", process=True, max_queue=4)
    await asyncio.wait_for(worker.load(partial(engine, tiny_dirs["llama"][0], 2)), 120)
    try:
        ids = [[5, 6, 7], [8, 9]]
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        seen = [0, 0]

        async def run(i):
            async for batch in worker.generate(ids[i], params):
                for event in batch:
                    if isinstance(event, RequestStats):
                        return event
                    seen[i] += isinstance(event, Step)

        tasks = [asyncio.create_task(run(i)) for i in range(2)]
        deadline = time.monotonic() + 30
        while min(seen) < 3 and time.monotonic() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        assert min(seen) >= 3, "the batch did not start"
        ranks = _rank_processes(worker.loop.pid)
        assert len(ranks) == 1
        # /health's view: each rank's process and memory (the CPU's: its resident set).
        shown = worker.runtime_status()["ranks"]
        assert [(r["rank"], r["pid"]) for r in shown] == [(0, worker.loop.pid), (1, ranks[0].pid)]
        assert all(r["memory_bytes"] > 0 for r in shown)
        os.kill(ranks[0].pid, signal.SIGKILL)
        for task in tasks:
            with pytest.raises(EngineProcessError):
                await asyncio.wait_for(task, 30)
        assert not worker.loaded  # so the registry loads it anew
    finally:
        await worker.aclose(10)

