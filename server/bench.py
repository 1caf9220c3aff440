"""/bench: the bench core driven over the server's own engine workers.

Each run is queued on its engine's worker like any request, so a bench never runs engine code
beside a request on the same engine, and requests that arrive mid-bench wait for at most one
run. References (transformers, mlx-lm) load their own copy of the model on a worker of their
own for the length of the bench. `duet bench` drives this same class in-process.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engines.base import ContextLengthExceeded, EngineError, check_context
from engines.bench import core, load
from engines.bench.report import device_label, environment
from engines.bench.systems import REFERENCES, ReferenceTarget
from engines.factory import backend_available, backend_missing
from engines.models.sources import resolve_model_dir

from .bench_gate import HEADER, LoadGate
from .errors import APIError, bad_request, from_engine_error, wrong_task
from .protocol import Text
from .registry import ModelRegistry
from .settings import Settings
from .worker import EngineWorker

log = logging.getLogger("duet.server")
STATIC_DIR = Path(__file__).resolve().parent / "static"

Preset = Literal["short", "long", "chat"]
Reference = Literal["transformers", "mlx-lm"]


class BenchRequest(BaseModel):
    # duet's own endpoint: a misspelt field is an error, not silently a default.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = Field(None, min_length=1, max_length=256,
                              description="default: the server's start-up model")
    engines: list[Literal["torch", "mlx"]] | None = Field(
        None, min_length=1, description="default: every engine whose backend is installed")
    preset: Preset = "short"
    prompts: list[Annotated[Text, Field(min_length=1, max_length=100_000)]] | None = Field(
        None, min_length=1, description="raw text prompts; replace the preset")
    max_tokens: int = Field(64, ge=1, description="tokens generated per run, end-of-sequence ignored")
    repeats: int = Field(3, ge=1, description="measured runs per prompt and engine")
    warmup: int = Field(1, ge=0, description="unmeasured runs per engine first")
    references: list[Reference] = Field(default_factory=list)
    clients: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, min_length=1, max_length=8,
        description="load mode: for each count, that many clients stream at once through this "
                    "server's HTTP API (each engine in turn), after `warmup` short unmeasured "
                    "rounds of as many clients; replaces repeats")
    stream: bool = False

    @field_validator("engines", "references", "clients")
    @classmethod
    def _distinct(cls, names):
        if names and len(set(names)) != len(names):
            raise ValueError("each value may appear once")
        return names


def check_limits(req: BenchRequest, settings: Settings) -> None:
    n_prompts = len(req.prompts) if req.prompts else len(core.PRESETS[req.preset])
    for param, value, setting in (
        ("max_tokens", req.max_tokens, "bench_max_tokens"),
        ("repeats", req.repeats, "bench_max_repeats"),
        ("warmup", req.warmup, "bench_max_warmup"),
        ("prompts", n_prompts, "bench_max_prompts"),
        ("clients", max(req.clients or [0]), "bench_max_clients"),
    ):
        limit = getattr(settings, setting)
        if value > limit:
            raise bad_request(
                f"{param} is {value}; this server allows at most {limit} "
                f"(DUET_{setting.upper()})", param=param, code="bench_limit_exceeded")


def bench_disabled() -> APIError:
    return APIError(403, "benchmarks are switched off on this server (DUET_BENCH_ENABLED=false)",
                    type="permission_error", code="bench_disabled")


@dataclass
class Target:
    name: str
    kind: core.TargetKind
    worker: EngineWorker
    info: dict
    reference: ReferenceTarget | None = None


@dataclass
class BenchRun:
    """A validated bench: engines loaded, prompts tokenized; events() runs it."""

    req: BenchRequest
    model: str
    model_dir: Callable[[], object]
    dtype: str
    context: int
    prompts: tuple[core.BenchPrompt, ...]
    prompt_ids: list[list[int]]
    targets: dict[str, Target]
    lock: asyncio.Lock
    device: str
    timeout_s: float | None = None  # each run's time limit, as for a request
    url: str | None = None  # this server, for the load mode's clients
    headers: dict = field(default_factory=dict)  # what they send (an API key)
    gate: LoadGate = field(default_factory=LoadGate)  # keeps other requests out meanwhile
    gone: threading.Event = field(default_factory=threading.Event)
    # Put in every load-mode prompt: a sweep run again on a server with the prefix cache on
    # would otherwise prefill nothing of the prompts it sent the first time.
    tag: str = field(default_factory=lambda: secrets.token_hex(3))

    async def events(self) -> AsyncIterator[dict]:
        records: list[core.RunRecord] = []
        errors: dict[str, str] = {}
        started = time.time()
        try:
            async with self.lock:  # one bench at a time: two would time each other
                yield self._start_event()
                async for event in self._until_compiled():
                    yield event
                if self.req.clients:
                    async for event in self._load_events(started):
                        yield event
                    return
                for name in self.req.references:
                    event = await self._load_reference(name)
                    if event["type"] == "error":
                        errors[name] = event["error"]["message"]
                    yield event
                plan = core.plan_runs(list(self.targets), len(self.prompts), self.req.repeats,
                                      self.req.warmup)
                for run in plan:
                    if self.gone.is_set():
                        break
                    if run.target in errors:
                        continue
                    try:
                        record = await self._run(run)
                    except Exception as exc:  # one failing target must not lose the others
                        log.exception("bench run on %s failed", run.target)
                        errors[run.target] = f"{type(exc).__name__}: {exc}"
                        yield _error(run.target, errors[run.target])
                        continue
                    if self.gone.is_set():  # cut short by a client that left: no figure
                        break
                    records.append(record)
                    yield {"type": "run", **record.to_dict()}
                yield self._summary(records, errors, started)
        finally:
            self.gone.set()  # stops a run still going on an engine thread
            self._unload_references()

    async def _until_compiled(self) -> AsyncIterator[dict]:
        """Engines still making their compiled step are waited for, each named in an event
        once: their eager steps until then are not what the bench compares. One whose compiled
        step failed is named with its error: its eager steps are what gets measured."""
        for name, target in self.targets.items():
            said = False
            while target.kind == "engine" and not self.gone.is_set():
                status = target.worker.runtime_status()
                if status is None or not status["compiling"]:
                    if status is not None and status["compile_error"]:
                        yield {"type": "compile_error", "target": name,
                               "message": status["compile_error"]}
                    break
                if not said:
                    said = True
                    yield {"type": "compiling", "target": name}
                await asyncio.sleep(0.1)

    async def _load_events(self, started: float) -> AsyncIterator[dict]:
        """The load mode: each engine in turn, each level of clients in turn, every client a
        stream through this server (engines/bench/load.py); then each reference, loaded for
        the bench, on one batch of the same prompts per level; then a summary of the levels.
        Other requests are kept out (429) until the references are done too: they would share
        the machine with what is timed."""
        levels: list[dict] = []
        errors: dict[str, str] = {}
        headers = {**self.headers, HEADER: self.gate.open()}
        try:
            sources = [*(self._engine_levels(name, headers) for name in list(self.targets)),
                       *(self._reference_levels(name) for name in self.req.references)]
            for source in sources:
                async for event in source:
                    yield self._keep(event, levels, errors)
        finally:
            self.gate.close()
        yield {
            "type": "summary", "mode": "load", "model": self.model,
            "date": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(timespec="seconds"),
            "preset": None if self.req.prompts else self.req.preset,
            "clients": list(self.req.clients), "max_tokens": self.req.max_tokens,
            "cancelled": self.gone.is_set(), "environment": environment(),
            "wall_s": round(time.time() - started, 3), "levels": levels,
            "ratios": load_ratios(levels, [n for n, t in self.targets.items()
                                           if t.kind == "engine"]),
            "errors": errors,
            "targets": {name: {"info": t.info} for name, t in self.targets.items()},
        }

    @staticmethod
    def _keep(event: dict, levels: list[dict], errors: dict[str, str]) -> dict:
        """Note a level or an error for the summary; the event goes on as it is."""
        if event["type"] == "level":
            levels.append({k: v for k, v in event.items() if k != "type"})
        elif event["type"] == "error":
            errors[event["target"]] = event["error"]["message"]
        return event

    async def _engine_levels(self, name: str, headers: dict) -> AsyncIterator[dict]:
        """An engine's levels (and their warm-up rounds) as events; it stops at an error."""
        def level(n: int, max_tokens: int, round_: str = "") -> dict:
            return load.run_level(self.url, self.model, n, 0, max_tokens, engine=name,
                                  procs=min(n, LOAD_PROCESSES),
                                  prompts=self._load_prompts(n, round_), headers=headers)

        for n in self.req.clients:
            if self.gone.is_set():
                return
            try:
                # Unmeasured rounds first, of prompts of their own (the prefix cache would
                # hand the measured ones their prefill): a batch size's first steps meet
                # lazy set-up (an H100's first 16-client level after a start: 6,056 tok/s
                # against 8,900 once warm), as the references' warm-up batch does.
                for i in range(self.req.warmup):
                    yield {"type": "warmup", "target": name, "clients": n}
                    await asyncio.to_thread(level, n, min(self.req.max_tokens, WARMUP_TOKENS),
                                            f"warm-up {i + 1}")
                    if self.gone.is_set():
                        return
                measured = await asyncio.to_thread(level, n, self.req.max_tokens)
            except Exception as exc:  # one failing engine must not lose the others
                log.exception("bench load level on %s failed", name)
                yield _error(name, f"{type(exc).__name__}: {exc}")
                return
            if self.gone.is_set():
                return
            yield {"type": "level", "target": name, **measured}

    async def _reference_levels(self, name: str) -> AsyncIterator[dict]:
        """A reference loaded for the bench, then its levels, as events; it stops at an
        error (one failing reference must not lose the rest)."""
        if self.gone.is_set():
            return
        event = await self._load_reference(name)
        yield event
        if event["type"] == "error":
            return
        for n in self.req.clients:
            if self.gone.is_set():
                return
            try:
                level = await self._reference_level(name, n)
            except Exception as exc:
                log.exception("bench load level on %s failed", name)
                yield _error(name, f"{type(exc).__name__}: {exc}")
                return
            if self.gone.is_set():
                return
            yield {"type": "level", "target": name, **level}

    async def _reference_level(self, name: str, n: int) -> dict:
        """A reference's batch of the n prompts the engines' clients sent, tokenized as an
        engine tokenized them."""
        engine = next(t for t in self.targets.values() if t.kind == "engine").worker.engine
        prompts = [core.BenchPrompt(f"client {i + 1}", text=p) if isinstance(p, str)
                   else core.BenchPrompt(f"client {i + 1}", messages=tuple(p))
                   for i, p in enumerate(self._load_prompts(n))]
        ids = await asyncio.to_thread(_tokenize, engine, prompts)
        reference = self.targets[name].reference
        return await self.targets[name].worker.call(
            "bench", lambda _engine, _stop: reference.run_level(ids, self.req.max_tokens),
            bounded=False)

    def _load_prompts(self, n: int, round_: str = "") -> list:
        """n prompts cycling over the bench's, each made distinct at its start (a client's own
        line, its level's and its run's too): clients sharing a prompt would otherwise share
        its prefill (the prefix cache), within a level, from one level to the next and from
        one sweep to the next."""
        prompts = []
        for i in range(n):
            p = self.prompts[i % len(self.prompts)]
            line = f"Client {i + 1} of {n}. Run {self.tag}{', ' + round_ if round_ else ''}."
            if p.messages is not None:
                prompts.append([{"role": "system", "content": line}, *p.messages])
            else:
                prompts.append(f"{line} {p.text}")
        return prompts

    def _start_event(self) -> dict:
        return {
            "type": "start", "model": self.model, "preset": None if self.req.prompts else self.req.preset,
            "prompts": self._prompt_info(),
            "max_tokens": self.req.max_tokens, "repeats": self.req.repeats,
            "warmup": self.req.warmup, "targets": [t.info for t in self.targets.values()],
            "references": list(self.req.references), "environment": environment(),
        }

    def _prompt_info(self) -> list[dict]:
        return [{"label": p.label, "prompt_tokens": len(ids)}
                for p, ids in zip(self.prompts, self.prompt_ids)]

    async def _load_reference(self, name: str) -> dict:
        ref = ReferenceTarget(name, device=self.device)
        worker = EngineWorker(f"bench-{name}", timeout_s=self.timeout_s)
        start = time.perf_counter()
        try:
            model_dir = await asyncio.to_thread(self.model_dir)
            info = await worker.run(ref.setup, model_dir, self.dtype, self.context)
        except Exception as exc:
            log.exception("bench reference %s could not be set up", name)
            worker.close()
            return _error(name, f"{type(exc).__name__}: {exc}")
        worker.engine = ref  # so that worker.close() tears it down on its thread
        info = {"name": name, "kind": "reference", **info,
                "device_name": device_label(info["device"]),
                "load_s": round(time.perf_counter() - start, 3)}
        self.targets[name] = Target(name, "reference", worker, info, ref)
        return {"type": "target", **info}

    async def _run(self, run: core.PlannedRun) -> core.RunRecord:
        target = self.targets[run.target]
        ids = self.prompt_ids[run.prompt]
        # Each run is a job on the worker: counted in its queue depth, bounded by the request
        # time limit, and never refused by the queue bound (a bench queues one run at a time).
        if target.reference is not None:
            # A reference's generate() cannot be stopped mid-run: it stops between runs.
            return await target.worker.call(
                "bench", lambda _engine, _stop: target.reference.run(run, ids, self.req.max_tokens),
                bounded=False)
        stats = await target.worker.call(
            "bench", partial(_engine_run, ids, self.req.max_tokens), bounded=False,
            also_stop=self.gone)
        return core.record_from_stats(run, stats)

    def _unload_references(self) -> None:
        # The worker closes its "engine" (the reference) on its own thread, after any run.
        for target in [t for t in self.targets.values() if t.reference is not None]:
            target.worker.close()
            del self.targets[target.name]

    def _summary(self, records: list[core.RunRecord], errors: dict, started: float) -> dict:
        summary = core.summarize(list(self.targets) + [n for n in errors if n not in self.targets],
                                 records, errors)
        for name, target in self.targets.items():
            summary["targets"][name]["info"] = target.info
        return {
            "type": "summary", "model": self.model,
            "date": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(timespec="seconds"),
            "preset": None if self.req.prompts else self.req.preset,
            "prompts": self._prompt_info(), "max_tokens": self.req.max_tokens,
            "repeats": self.req.repeats, "warmup": self.req.warmup,
            "cancelled": self.gone.is_set(), "environment": environment(),
            "wall_s": round(time.time() - started, 3), **summary,
        }


# The load mode's client processes (at most; one per client below that): each sends its share
# of a level's streams from one event loop. Four on a small machine; half the cores on a big
# one: on a 16-core H100 host four processes spent 2.5 cores' time on 64 clients' streams
# (client_cpu_share), enough to slow what they measure.
LOAD_PROCESSES = min(16, max(4, (os.cpu_count() or 8) // 2))
# A warm-up round's tokens a stream (at most: max_tokens if fewer).
WARMUP_TOKENS = 8


def load_ratios(levels: list[dict], engines: list[str] | None = None) -> dict[str, float]:
    """Each engine's aggregate tok/s over every other target's (engine or reference), level by
    level. engines: the targets that are engines (default: every target)."""
    by = {(lv["target"], lv["clients"]): lv["aggregate_tok_s"] for lv in levels}
    names = list(dict.fromkeys(t for t, _ in by))
    engines = names if engines is None else engines
    return {f"{a} / {b} @ {n}": round(by[(a, n)] / by[(b, n)], 3)
            for a in names if a in engines for b in names if a != b
            for (t, n) in list(by) if t == a and (b, n) in by and by[(b, n)] > 0}


def _engine_run(ids: list[int], max_tokens: int, engine, should_stop):
    # A module-level function: a job's function travels to the engine's process by pickle.
    return core.engine_run(engine, ids, max_tokens, should_stop)


def _error(target: str, message: str) -> dict:
    return {"type": "error", "target": target,
            "error": {"message": message, "type": "server_error", "param": None, "code": None}}


class BenchService:
    def __init__(self, registry: ModelRegistry, settings: Settings, default_model: str,
                 gate: LoadGate | None = None):
        self.registry = registry
        self.settings = settings
        self.default_model = default_model
        self.lock = asyncio.Lock()
        self.gate = gate or LoadGate()

    async def prepare(self, req: BenchRequest, url: str | None = None,
                      headers: dict | None = None) -> BenchRun:
        """url, headers: where the load mode's clients reach this server, and what they send."""
        if not self.settings.bench_enabled:
            raise bench_disabled()
        check_limits(req, self.settings)
        if req.clients and url is None:
            raise bad_request("load mode needs the server's HTTP address (POST /bench)",
                              param="clients", code="unsupported_parameter")
        spec = self.registry.spec(req.model or self.default_model)
        if spec.task != "generate":
            raise wrong_task(spec.id, spec.task, ("generate",))
        factory = self.registry.factory
        engines = req.engines or [n for n in factory.names if factory.available(n)]
        if not engines:
            raise bad_request("no engine backend is installed", param="engines",
                              code="engine_unavailable")
        for name in req.references:
            backend = REFERENCES[name][1]
            if not backend_available(backend):
                raise _with_param(from_engine_error(backend_missing(backend)), "references")
        prompts = core.resolve_prompts(req.preset, req.prompts)
        targets: dict[str, Target] = {}
        prompt_ids: list[list[int]] = []
        for name in engines:
            try:
                worker = await self.registry.worker(spec.id, name)
            except EngineError as exc:
                raise _with_param(from_engine_error(exc), "engines") from exc
            ids = await asyncio.to_thread(_tokenize, worker.engine, prompts)
            _check_fits(ids, req.max_tokens, worker.engine.info.context_length)
            prompt_ids = prompt_ids or ids  # the same model files: the same tokens everywhere
            info = worker.engine.info
            targets[name] = Target(name, "engine", worker, {
                "name": name, "kind": "engine", "device": info.device,
                "device_name": device_label(info.device), "dtype": info.dtype,
                "backend_version": info.backend_version, "context_length": info.context_length,
                "memory_measure": info.memory_measure,
            })
        return BenchRun(req, spec.id, lambda: resolve_model_dir(spec), spec.dtype,
                        spec.context_length, prompts, prompt_ids, targets, self.lock,
                        self.settings.device, self.settings.request_timeout_s, url,
                        dict(headers or {}), self.gate)


def _with_param(err: APIError, param: str) -> APIError:
    err.param = param
    return err


def _tokenize(engine, prompts) -> list[list[int]]:
    try:
        return [p.token_ids(engine) for p in prompts]
    except ValueError as exc:  # e.g. the chat preset on a model without a chat template
        raise bad_request(str(exc), param="preset") from exc


def _check_fits(prompt_ids: list[list[int]], max_tokens: int, context: int) -> None:
    for ids in prompt_ids:
        if not ids:
            raise bad_request("a prompt is empty once tokenized", param="prompts")
        try:
            check_context(len(ids), max_tokens, context)
        except ContextLengthExceeded as exc:
            raise _with_param(from_engine_error(exc), "prompts") from exc


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def own_url(request) -> str:
    """Where this server listens, as its own clients reach it: loopback for an address that
    means every interface."""
    host, port = request.scope.get("server") or ("127.0.0.1", 80)
    if host in ("0.0.0.0", "::", "") or host is None:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def respond(service: BenchService, req: BenchRequest, request=None):
    """POST /bench: validate (errors are plain HTTP errors), then a JSON summary or SSE events.

    A client that leaves has this request cancelled (server/request_guard.py); the cancellation
    lands inside run.events(), whose clean-up stops the run on the engine thread."""
    from fastapi.responses import JSONResponse, StreamingResponse

    from .streaming import DONE, sse

    auth = request.headers.get("authorization") if request is not None else None
    run = await service.prepare(req, own_url(request) if request is not None else None,
                                {"Authorization": auth} if auth else {})
    if req.stream:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in run.events():
                    yield sse(event)
            except Exception as exc:
                log.exception("bench failed")
                yield sse(_error("bench", f"{type(exc).__name__}: {exc}"))
            yield DONE

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
    runs: list[dict] = []
    summary: dict = {}
    async for event in run.events():
        if event["type"] == "run":
            runs.append({k: v for k, v in event.items() if k != "type"})
        elif event["type"] == "summary":
            summary = event
    summary.pop("type", None)
    return JSONResponse(summary if req.clients else {**summary, "runs": runs})
