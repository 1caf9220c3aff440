"""engines/bench: run order, statistics, prompts, one run on each kind of target (duet's
engines and the transformers / mlx-lm references) on a tiny random model, the report's labels,
and the package's one-way imports."""

import ast
from pathlib import Path

import numpy as np
import pytest

from engines.base import Cancelled
from engines.bench import core, load, report, systems
from engines.fake import FakeEngine


def test_plan_warms_up_first_then_interleaves_targets():
    plan = core.plan_runs(["torch", "mlx"], n_prompts=3, repeats=2, warmup=2)
    warm, measured = plan[:4], plan[4:]
    assert all(r.warmup for r in warm) and not any(r.warmup for r in measured)
    assert [r.target for r in warm] == ["torch", "mlx"] * 2
    assert len(measured) == 2 * 3 * 2
    assert [r.target for r in measured] == ["torch", "mlx"] * 6
    for target in ("torch", "mlx"):
        mine = [(r.repeat, r.prompt) for r in measured if r.target == target]
        assert mine == [(rep, p) for rep in range(2) for p in range(3)]


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
def test_p90_is_the_inclusive_90th_percentile(values):
    assert core.p90(values) == pytest.approx(np.percentile(values, 90))


def _record(target, decode, ttft, warmup=False, peak=100):
    return core.RunRecord(target, "engine", 0, 0, warmup, 10, 8, ttft, 10 / ttft, decode, peak,
                          50, ttft + 7 / decode)


def test_summary_ignores_warm_up_and_ratios_pairs_every_target():
    records = [_record("a", 100.0, 0.1, warmup=True), _record("a", 10.0, 0.2),
               _record("a", 20.0, 0.4), _record("a", 30.0, 0.3), _record("b", 5.0, 0.2),
               _record("c", 40.0, 0.1, peak=0)]
    s = core.summarize(["a", "b", "c", "d"], records, errors={"d": "it broke"})
    a = s["targets"]["a"]
    assert a["runs"] == 3 and a["decode_tokens_per_s"]["median"] == 20.0
    assert a["ttft_s"]["median"] == 0.3 and a["ttft_s"]["p90"] == pytest.approx(0.38)
    assert s["targets"]["d"] == {"runs": 0, "error": "it broke"}
    assert list(s["ratios"]) == ["a / b", "a / c", "b / c"]
    assert s["ratios"]["a / b"]["decode_tokens_per_s"] == pytest.approx(4.0)
    assert s["ratios"]["a / b"]["ttft_s"] == pytest.approx(1.5)
    assert s["ratios"]["a / c"]["peak_memory_bytes"] is None


def test_presets_and_explicit_prompts():
    assert set(core.PRESETS) == {"short", "long", "chat"}
    engine = FakeEngine()
    long_ids = [p.token_ids(engine) for p in core.PRESETS["long"]]
    short_ids = [p.token_ids(engine) for p in core.PRESETS["short"]]
    assert min(map(len, long_ids)) > 5 * max(map(len, short_ids))
    chat = core.PRESETS["chat"][0].token_ids(engine)
    assert bytes(chat).decode() == engine.tokenizer.decode(
        engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    mine = core.resolve_prompts("long", ["one", "two"])
    assert [p.text for p in mine] == ["one", "two"]
    with pytest.raises(ValueError, match="unknown preset"):
        core.resolve_prompts("huge", None)


def test_engine_run_is_greedy_fixed_length_and_runs_past_end_of_sequence():
    params = core.bench_params(12)
    assert params.greedy and params.ignore_eos and params.max_tokens == 12
    engine = FakeEngine(reply="ab")  # its script ends with end-of-sequence after 2 bytes
    stats = core.engine_run(engine, [1, 2, 3], 12)
    # The end-of-sequence token did not stop it (the fake repeats it once its script is out).
    assert stats.finish_reason == "length" and stats.completion_tokens == 12
    asked = iter([False] + [True] * 100)  # stop once the first step is done
    stopped = core.engine_run(FakeEngine(reply="x" * 50), [1], 40, should_stop=lambda: next(asked))
    assert stopped.finish_reason == "cancelled" and stopped.completion_tokens == 1
    with pytest.raises(Cancelled):  # stopped before it ever ran: nothing to report
        core.engine_run(FakeEngine(reply="x" * 50), [1], 40, should_stop=lambda: True)


@pytest.mark.parametrize("name", ["transformers", "mlx-lm"])
def test_reference_runs_on_a_tiny_model(tiny_dirs, name):
    if name == "mlx-lm":
        pytest.importorskip("mlx_lm")
    path, _ = tiny_dirs["llama"]
    ref = systems.ReferenceTarget(name, device="cpu")
    info = ref.setup(path, "float32", 128)
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    assert name.split("-")[0] in info["backend_version"]
    run = core.PlannedRun(name, 1, 2, False)
    record = ref.run(run, [5, 70, 80, 90, 33], 6)
    assert (record.target, record.kind, record.prompt, record.repeat) == (name, "reference", 1, 2)
    assert record.prompt_tokens == 5 and record.completion_tokens == 6
    assert record.ttft_s > 0 and record.decode_tokens_per_s > 0 and record.peak_memory_bytes > 0
    assert record.total_s >= record.ttft_s and record.kv_cache_bytes is None
    ref.close()


@pytest.mark.parametrize("name", ["transformers", "mlx-lm"])
def test_reference_level_batches_prompts_of_unequal_lengths(tiny_dirs, name):
    """The load mode's reference figure: one batch of every client's prompt (their lengths
    differ, as tokenized texts do), each given all of max_tokens."""
    if name == "mlx-lm":
        pytest.importorskip("mlx_lm")
    path, _ = tiny_dirs["llama"]
    ref = systems.ReferenceTarget(name, device="cpu")
    ref.setup(path, "float32", 128)
    level = ref.run_level([[5, 70, 80], [9, 8, 7, 6, 5, 4, 3], [40]], 5)
    ref.close()
    assert tuple(level) == load.LEVEL_KEYS
    assert level["clients"] == 3 and level["tokens"] == 15
    wall = level["wall_s"]  # rounded to the millisecond
    assert 15 / (wall + 5e-4) - 0.1 <= level["aggregate_tok_s"] <= 15 / (wall - 5e-4) + 0.1
    assert level["ttft_ms_p50"] is None and level["peak_batch"] is None  # no counterpart


def test_left_padding_gives_each_prompt_what_it_gets_alone(tiny_dirs):
    """transformers' batched generate() over pad_left's ids and mask: each row's greedy tokens
    are the ones its prompt gets alone (float32), so a reference's batch of unequal prompts
    does the work the clients' requests do."""
    import torch

    _, model = tiny_dirs["llama"]
    prompts = [[5, 70, 80, 90, 33], [9, 8], [40, 41, 42]]
    ids, mask = systems.pad_left(prompts)
    assert ids[1] == [0, 0, 0, 9, 8] and mask[1] == [0, 0, 0, 1, 1]
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batch = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), **kw)
        for row, prompt in zip(batch, prompts):
            alone = model.generate(torch.tensor([prompt]), **kw)[0, len(prompt):]
            assert row[-6:].tolist() == alone.tolist()


def test_a_server_level_has_every_figure_a_reference_level_has():
    result = {"sent": 0.0, "chunks": [0.1, 0.2, 0.3], "tokens": 3, "server_ttft_s": 0.05,
              "server_queue_s": 0.0, "peak_memory_bytes": 7}
    seen = {"batch": 1, "kv_used": 10, "rss_start": 100, "rss_peak": 150}
    level = load.summarize_level(1, [result], seen, 0.01)
    assert tuple(level) == load.LEVEL_KEYS
    assert level["rss_peak_delta_bytes"] == 50 and level["engine_peak_memory_bytes"] == 7
    no_rss = load.summarize_level(1, [result], {"batch": 1, "kv_used": 0}, 0.01)
    assert no_rss["rss_peak_delta_bytes"] is None  # not measured is not zero
    assert no_rss["gc_pause_ms"] is None and no_rss["gc_oldest_collections"] is None
    # The engine's garbage collections over the level: its last poll less its first.
    collected = load.summarize_level(1, [result], {**seen, "gc_start": (120.5, 3),
                                                   "gc_end": (370.5, 5)}, 0.01)
    assert (collected["gc_pause_ms"], collected["gc_oldest_collections"]) == (250.0, 2)
    assert tuple(load.reference_level(2, 10, 1.0)) == load.LEVEL_KEYS


def test_device_label_names_the_hardware():
    assert "CPU" in report.device_label("cpu")
    assert "GPU" in report.device_label("metal")
    env = report.environment()
    assert "CPU cores" in env["host"] and {"python", "torch"} <= set(env["versions"])


def test_marked_section_replaces_only_its_own_block(tmp_path):
    md = tmp_path / "bench.md"
    md.write_text("# Title\n")
    report.write_marked_section(md, "a", "one\n")
    report.write_marked_section(md, "b", "two\n")
    report.write_marked_section(md, "a", "three\n")
    assert md.read_text() == ("# Title\n\n<!-- bench:a -->\nthree\n<!-- /bench:a -->\n\n"
                              "<!-- bench:b -->\ntwo\n<!-- /bench:b -->\n")


def test_bench_modules_import_one_way_and_no_backend_at_import():
    """core and load import no sibling, report only core; systems may import all three.
    Backends are imported inside functions only, so importing the package needs none of them."""
    allowed = {"core": set(), "load": set(), "report": {"core"},
               "systems": {"core", "load", "report"}}
    package = Path(systems.__file__).parent
    for name, may in allowed.items():
        tree = ast.parse((package / f"{name}.py").read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        siblings = {n.module for n in top if isinstance(n, ast.ImportFrom) and n.level == 1}
        assert siblings <= may, (name, siblings - may)
        modules = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.level == 0}
        backends = {m for m in modules if m.split(".")[0] in ("torch", "transformers", "mlx", "mlx_lm")}
        assert not backends, (name, backends)


def test_step_in_waves_adds_a_wave_a_step_and_returns_with_every_request_done():
    from engines.base import SamplingParams
    from engines.runtime.runtime import Runtime

    engine = FakeEngine(max_batch=4, reply="abc", threaded_output=True)
    runtime = Runtime(engine)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    stats, steps = core.step_in_waves(runtime, [[[1], [2]], [[3]]], params)
    runtime.close()
    assert len(stats) == 3 and all(s.completion_tokens == 4 for s in stats)  # "abc" + EOS
    # The third prompt came a step after the first two: it was prefilled alone.
    assert engine.calls == [[1], [2], [3]] and engine.steps[:2] == [2, 3]
    assert len(steps) >= len(engine.steps) and engine.kv_pool.used_blocks == 0
