"""The bench core behind /bench, `duet bench` and scripts/bench_engines.py: which prompts, which
runs in which order, how one run is measured, and how runs become a summary (medians, p90,
ratios).

It knows nothing of threads, HTTP or backends: a driver (server/bench.py, the scripts) decides
where each run executes; the systems it times are those of engines/bench/systems.py, or anything
with the same setup / run / teardown shape.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from ..base import RequestStats, SamplingParams
from ..runtime.runtime import Submission

TargetKind = Literal["engine", "reference"]
METRICS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
           "kv_cache_bytes", "total_s")
# What a ratio "a / b" compares; for ttft and memory below 1 means a is better.
RATIO_METRICS = ("decode_tokens_per_s", "prefill_tokens_per_s", "ttft_s", "peak_memory_bytes")


# ---------------------------------------------------------------- prompts
@dataclass(frozen=True)
class BenchPrompt:
    """A raw text prompt, or a conversation that goes through the model's chat template."""

    label: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None

    def token_ids(self, engine) -> list[int]:
        if self.messages is not None:
            return engine.apply_chat_template(list(self.messages))
        return engine.tokenize(self.text or "")


_DOCUMENT = (
    "The river rises in the hills above the town, where three springs meet in a pool that "
    "never freezes. For centuries the mill downstream ground the valley's grain, and the "
    "millers kept a ledger of every flood, drought and harvest. In the dry years the ledger "
    "records prayers for rain; in the wet years it records the cost of rebuilding the weir. "
    "When the railway arrived, the mill turned to sawing timber, and the ledger began to list "
    "the names of the forests that fed it. The last miller closed the doors in the spring of "
    "a cold year, sold the great wheel to a museum and gave the ledger to the school, where "
    "children still read it to learn how weather, trade and work shaped the place they live. "
)


def _document(sections: int) -> str:
    parts = [f"Section {i + 1}. {_DOCUMENT}" for i in range(sections)]
    return "\n\n".join(parts) + "\n\nSummary of the document above, in three sentences:"


PRESETS: dict[str, tuple[BenchPrompt, ...]] = {
    "short": (
        BenchPrompt("capital", text="The capital of France is"),
        BenchPrompt("story", text="Once upon a time, in a village by the sea,"),
        BenchPrompt("recipe", text="To bake a simple loaf of bread, you need"),
        BenchPrompt("code", text="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ),
    "long": (
        BenchPrompt("document-3", text=_document(3)),
        BenchPrompt("document-6", text=_document(6)),
    ),
    "chat": (
        BenchPrompt("capital", messages=(
            {"role": "user", "content": "What is the capital of France?"},)),
        BenchPrompt("colours", messages=(
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "Name three colours of the rainbow."})),
        BenchPrompt("follow-up", messages=(
            {"role": "user", "content": "Suggest a name for a grey cat."},
            {"role": "assistant", "content": "How about Ash?"},
            {"role": "user", "content": "Another one, and explain why it suits a grey cat."})),
    ),
}


def resolve_prompts(preset: str | None, texts: Sequence[str] | None) -> tuple[BenchPrompt, ...]:
    if texts:
        return tuple(BenchPrompt(f"prompt-{i + 1}", text=t) for i, t in enumerate(texts))
    try:
        return PRESETS[preset or "short"]
    except KeyError:
        raise ValueError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})") from None


# ---------------------------------------------------------------- runs
@dataclass(frozen=True)
class PlannedRun:
    target: str
    prompt: int
    repeat: int
    warmup: bool


def plan_runs(targets: Sequence[str], n_prompts: int, repeats: int, warmup: int) -> list[PlannedRun]:
    """Warm-up runs first, then the measured runs with targets interleaved run by run, so slow
    drift on a shared machine (other load, thermal throttling) hits every target alike."""
    plan = [PlannedRun(t, i % n_prompts, i, True) for i in range(warmup) for t in targets]
    plan += [PlannedRun(t, p, r, False)
             for r in range(repeats) for p in range(n_prompts) for t in targets]
    return plan


@dataclass(frozen=True)
class RunRecord:
    target: str
    kind: TargetKind
    prompt: int
    repeat: int
    warmup: bool
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int
    kv_cache_bytes: int | None  # None where a reference does not say
    total_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def bench_params(max_tokens: int) -> SamplingParams:
    """Greedy, for exactly max_tokens tokens: what every target is asked to do."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def record_from_stats(run: PlannedRun, stats: RequestStats) -> RunRecord:
    return RunRecord(
        run.target, "engine", run.prompt, run.repeat, run.warmup, stats.prompt_tokens,
        stats.completion_tokens, stats.ttft_s, stats.prefill_tokens_per_s,
        stats.decode_tokens_per_s, stats.peak_memory_bytes, stats.kv_cache_bytes, stats.total_s,
    )


def engine_run(engine, prompt_ids: Sequence[int], max_tokens: int,
               should_stop: Callable[[], bool] | None = None) -> RequestStats:
    """One bench run on a duet engine (call it on the engine's own thread)."""
    for event in engine.generate(prompt_ids, bench_params(max_tokens), should_stop):
        if isinstance(event, RequestStats):
            return event
    raise RuntimeError(f"the {engine.name} engine ended without statistics")


def step_in_waves(runtime, waves: Sequence[Sequence[Sequence[int]]], params: SamplingParams
                  ) -> tuple[list[RequestStats], list[float]]:
    """Step a runtime (engines/runtime) until it is idle, adding each wave of prompts a step
    after the one before, as requests reaching a server a few ms apart. Returns the requests'
    stats and each step's seconds; every event is out on return."""
    stats: list[RequestStats] = []
    steps = []
    pending = [list(w) for w in waves if w]
    while pending or runtime.has_work:
        for prompt in pending.pop(0) if pending else ():
            runtime.add(Submission(list(prompt), params, lambda e: isinstance(e, RequestStats)
                                   and stats.append(e)))
        tic = time.perf_counter()
        runtime.step()
        steps.append(time.perf_counter() - tic)
    runtime.delivery.drain()
    return stats, steps


# ---------------------------------------------------------------- a system's measurements
@dataclass
class Measurement:
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int


@dataclass
class Result:
    system: str
    prompt_tokens: int
    new_tokens: int
    runs: list[Measurement] = field(default_factory=list)
    error: str | None = None

    def median(self, key: str) -> float:
        return statistics.median(getattr(m, key) for m in self.runs) if self.runs else float("nan")


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids drawn at random (seeded by n), for systems that take ids, not text."""
    rng = random.Random(seed + n)
    return [rng.randrange(3, min(vocab, 30000)) for _ in range(n)]


# ---------------------------------------------------------------- the timing loop
def run_systems(systems, model_dir: Path, dtype: str, context: int, prompt_lens: list[int],
                new_tokens: int, repeats: int, vocab: int, log=print) -> list[Result]:
    """The systems loaded together and their runs taken in turn, so slow drifts of the
    machine (clocks, host load) fall on all of them alike (pass one system to run it alone).
    A system that fails keeps its error and never loses the others' numbers."""
    results = {s.name: [Result(s.name, n, new_tokens) for n in prompt_lens] for s in systems}

    def fail(system, exc: Exception) -> None:
        log(f"{system.name}: failed: {type(exc).__name__}: {exc}")
        for res in results[system.name]:
            res.error = f"{type(exc).__name__}: {exc}"

    live = []
    for system in systems:
        try:
            started = time.perf_counter()
            system.setup(model_dir, dtype, context)
            for res in results[system.name]:  # warm-up: compiles, graph captures, allocator growth
                system.run(random_prompt(res.prompt_tokens, vocab), new_tokens)
            log(f"{system.name}: set up and warmed up in {time.perf_counter() - started:.1f}s")
            live.append(system)
        except Exception as exc:
            fail(system, exc)
    try:
        for i, n in enumerate(prompt_lens):
            for _ in range(repeats):
                for system in list(live):
                    try:
                        results[system.name][i].runs.append(system.run(random_prompt(n, vocab), new_tokens))
                    except Exception as exc:
                        fail(system, exc)
                        live.remove(system)
    finally:
        for system in systems:
            try:
                system.teardown()
            except Exception:
                pass
    return [r for s in systems for r in results[s.name]]


# ---------------------------------------------------------------- summary
def p90(values: Sequence[float]) -> float:
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def summarize_target(records: Iterable[RunRecord]) -> dict:
    measured = [r for r in records if not r.warmup]
    if not measured:
        return {"runs": 0}
    out: dict = {"runs": len(measured), "kind": measured[0].kind,
                 "prompt_tokens": statistics.median(r.prompt_tokens for r in measured),
                 "completion_tokens": statistics.median(r.completion_tokens for r in measured)}
    for key in METRICS:
        values = [getattr(r, key) for r in measured if getattr(r, key) is not None]
        out[key] = {"median": statistics.median(values), "p90": p90(values)} if values else None
    return out


def ratios(per_target: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """'a / b' of the medians for every pair of measured targets, a before b in run order."""
    names = [n for n, s in per_target.items() if s.get("runs")]
    out: dict[str, dict[str, float | None]] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pair = {}
            for key in RATIO_METRICS:
                sa, sb = per_target[a][key], per_target[b][key]
                # JSON has no NaN: a ratio with nothing to divide by is null.
                pair[key] = sa["median"] / sb["median"] if sa and sb and sb["median"] else None
            out[f"{a} / {b}"] = pair
    return out


def summarize(targets: Sequence[str], records: Sequence[RunRecord],
              errors: dict[str, str] | None = None) -> dict:
    per_target = {}
    for name in targets:
        summary = summarize_target(r for r in records if r.target == name)
        if errors and name in errors:
            summary["error"] = errors[name]
        per_target[name] = summary
    return {"targets": per_target, "ratios": ratios(per_target)}
