"""Which models exist (models.toml) and which engines are loaded for them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

from engines.base import Engine, EngineError, UnsupportedModel
from engines.device import choose_device, choose_dtype, cuda_visible
from engines.device import default_memory_budget as device_memory_budget
from engines.factory import (
    ENGINE_NAMES,
    backend_available,
    backend_missing,
    create_engine,
    import_backend,
    resolve_engine_name,
)
from engines.keep_alive import parse_keep_alive
from engines.memory import Estimate
from engines.models.config import ModelSpec
from engines.models.sources import resolve_model_dir
from engines.runtime.process import wants_process
from engines.runtime.sizing import RuntimeOptions

from .errors import APIError, echo, model_not_found
from .residency import Residency
from .worker import EngineWorker

log = logging.getLogger("duet.server")


class EngineFactory(Protocol):
    names: tuple[str, ...]

    def available(self, name: str) -> bool: ...

    def create(self, name: str, spec: ModelSpec, kv_cache_limit: int | None = None
               ) -> Engine: ...

    def estimate(self, name: str, spec: ModelSpec) -> Estimate: ...

    def default_memory_budget(self) -> int: ...

    def prepare(self, name: str) -> None:
        """Import what create(name) needs, in an engine's process before it is asked to load.
        Pickles, as create does."""


class BackendEngineFactory:
    """The real engines: resolve the model's files, then build the engine."""

    names = ENGINE_NAMES

    def __init__(self, runtime_options: RuntimeOptions | None = None, tensor_parallel: int = 1,
                 **torch_options):
        self.runtime_options = runtime_options or RuntimeOptions()
        self.tensor_parallel = tensor_parallel  # a model's own in models.toml wins
        self.torch_options = torch_options

    def available(self, name: str) -> bool:
        return backend_available(name)

    def create(self, name: str, spec: ModelSpec, kv_cache_limit: int | None = None) -> Engine:
        """kv_cache_limit: the most KV cache the memory budget leaves it; within it the engine
        sizes its own (its default, bounded on a GPU by the memory free once it loaded)."""
        model_dir = resolve_model_dir(spec)
        options = self.torch_options if name == "torch" else {}
        runtime = self.runtime_options
        if kv_cache_limit is not None and spec.task == "generate":
            runtime = dataclasses.replace(runtime, kv_cache_limit=kv_cache_limit)
        # The server's --tensor-parallel is the torch engine's default; a model's own asks it of
        # whichever engine serves it.
        ranks = tensor_parallel(spec, self.tensor_parallel if name == "torch" else 1)
        if ranks > 1:
            if name != "torch":
                raise UnsupportedModel(f"tensor parallelism ({ranks} ranks) is the torch "
                                       f"engine's; the {name} engine serves on one device")
            options = {**options, "tensor_parallel": ranks}
        return create_engine(
            name, model_dir, context_length=spec.context_length, dtype=spec.dtype,
            task=spec.task, quantize=spec.quantize, runtime_options=runtime, **options,
        )

    def prepare(self, name: str) -> None:
        import_backend(name)

    def _device(self) -> str:
        return choose_device(self.torch_options.get("device", "auto"))

    def estimate(self, name: str, spec: ModelSpec) -> Estimate:
        """The model's weights and KV cache before it loads (files converted first, once)."""
        import json

        from engines.memory import kv_bytes_per_token, weights_bytes
        from engines.quantization import resolve as resolve_quantization

        model_dir = resolve_model_dir(spec)
        cfg = json.loads((model_dir / "config.json").read_text())
        if spec.task != "generate":  # an encoder: its files' bytes, and no KV cache
            size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
            return Estimate(size, 0, 0)
        device = self._device() if name == "torch" else "mlx"
        dtype = choose_dtype(spec.dtype, device) if name == "torch" else (
            "float32" if spec.dtype == "float32" else "bfloat16")
        quant = resolve_quantization(spec.quantize, cfg, name)
        # The budget is one device's: a model split over GPUs takes each one's share there; ranks
        # on the CPU share its RAM, and take it whole.
        ranks = tensor_parallel(spec, self.tensor_parallel) \
            if name == "torch" and device.startswith("cuda") else 1
        per_token = kv_bytes_per_token(cfg, dtype) // ranks
        return Estimate(weights_bytes(cfg, dtype, quant, ranks), per_token, spec.context_length)

    def default_memory_budget(self) -> int:
        return device_memory_budget(self._device())


class ModelRegistry:
    def __init__(
        self,
        specs: list[ModelSpec],
        factory: EngineFactory,
        engine_override: dict[str, str] | None = None,
        *,
        max_queue: int | None = None,
        request_timeout_s: float | None = None,
        engine_process: ProcessPolicy | None = None,
        keep_alive: str | float = -1,
        max_loaded: int | None = None,
        memory_budget: int | None = None,
    ):
        """engine_process(spec, engine name) says whether that engine runs in a process of its
        own (engines/runtime/process.py), and its likely() guesses so without importing torch
        (the process then starts first); by default none does. keep_alive: how long an engine
        stays loaded after a request unless the model or the request says otherwise (-1: for
        good); max_loaded: how many engines may be loaded at once (None: no bound), the least
        recently used idle one unloaded to make room; memory_budget: bytes that the weights
        and KV caches of every loaded engine share (None: the factory's default for the
        device, asked on the first load)."""
        self.specs = {s.id: s for s in specs}
        self._engine_process = engine_process
        self._worker_options = {"max_queue": max_queue, "timeout_s": request_timeout_s}
        self.factory = factory
        self._default_engine = {
            s.id: _default_engine(s, (engine_override or {}).get(s.id, s.engine)) for s in specs
        }
        self._workers: dict[tuple[str, str], EngineWorker] = {}
        self._loading: dict[tuple[str, str], asyncio.Lock] = {}
        self.residency = Residency(parse_keep_alive(keep_alive))
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        # One load at a time decides what fits, so two never count the same free memory.
        self._load_lock = asyncio.Lock()

    def spec(self, model_id: str) -> ModelSpec:
        try:
            return self.specs[model_id]
        except KeyError:
            raise model_not_found(model_id) from None

    def default_engine(self, model_id: str) -> str:
        return self._default_engine[model_id]

    def is_loaded(self, model_id: str, engine: str) -> bool:
        worker = self._workers.get((model_id, engine))
        return worker is not None and worker.loaded

    def loaded_worker(self, model_id: str, engine: str) -> EngineWorker | None:
        worker = self._workers.get((model_id, engine))
        return worker if worker is not None and worker.loaded else None

    def residency_of(self, model_id: str, engine: str) -> dict:
        return self.residency.describe((model_id, engine), time.monotonic())

    def loaded_info(self, model_id: str, engine: str):
        worker = self.loaded_worker(model_id, engine)
        return worker.engine.info if worker is not None else None

    def _keep_alive_s(self, spec: ModelSpec, requested: str | float | None) -> float | None:
        if requested is not None:
            return parse_keep_alive(requested)
        if spec.keep_alive is not None:
            return parse_keep_alive(spec.keep_alive)
        return self.residency.default_keep_alive_s

    async def worker(self, model_id: str, engine: str | None = None,
                     keep_alive: str | float | None = None) -> EngineWorker:
        """The worker of a loaded engine, loading it on first use. keep_alive: this request's
        (None: the model's, else the server's)."""
        spec = self.spec(model_id)
        name = self.default_engine(model_id) if engine in (None, "auto") else engine
        if name not in self.factory.names:
            raise APIError(400, f"unknown engine '{echo(name)}'", param="engine", code="invalid_value")
        key = (spec.id, name)
        keep_s = self._keep_alive_s(spec, keep_alive)
        worker = self._workers.get(key)
        if worker is not None and worker.loaded:
            self.residency.used(key, keep_s, time.monotonic())
            return worker
        lock = self._loading.setdefault(key, asyncio.Lock())
        async with lock:
            worker = self._workers.get(key)
            if worker is not None and worker.loaded:
                self.residency.used(key, keep_s, time.monotonic())
                return worker
            if not self.factory.available(name):
                raise backend_missing(name)  # names the extra to install
            async with self._load_lock:
                return await self._load(key, spec, keep_s)

    async def _load(self, key: tuple[str, str], spec: ModelSpec, keep_s: float | None
                    ) -> EngineWorker:
        name = key[1]
        if key in self._workers:  # lost (its process died or is ending): gone before anew
            await self._unload(key, timeout_s=10.0)
        label = f"{spec.id}/{name}"
        policy = self._engine_process
        worker = None
        try:
            if policy is not None and policy.likely(spec, name):
                # Started before deciding (which may import torch here: seconds), it imports
                # its backend meanwhile (seconds there), and while the budget is worked out.
                worker = await self._process_worker(label, name)
            # A thread: deciding may import torch (seconds), which must not stall the server.
            process = policy is not None and await asyncio.to_thread(policy, spec, name)
            if worker is not None and not process:  # the guess was wrong: it runs in this one
                self._discard(worker)
                worker = None
            if worker is None:
                worker = (await self._process_worker(label, name) if process
                          else EngineWorker(label, **self._worker_options))
            await self._make_room(key)
            kv_limit = await self._fit_budget(key, spec)
            # A partial, not a lambda: it is pickled when the engine has its own process.
            await worker.load(partial(self.factory.create, name, spec, kv_limit))
        except (EngineError, APIError):
            self._discard(worker)
            raise
        except Exception as exc:
            self._discard(worker)
            log.exception("loading %s on %s failed", spec.id, name)
            raise APIError(
                503, f"model '{spec.id}' could not be loaded on the {name} engine: {exc}",
                type="server_error", code="model_unavailable",
            ) from exc
        self._workers[key] = worker
        self.residency.used(key, keep_s, time.monotonic())
        return worker

    async def _process_worker(self, label: str, name: str) -> EngineWorker:
        """A worker whose engine process starts now, importing the named engine's backend
        until it is told what to build."""
        worker = EngineWorker(label, process=True, **self._worker_options)
        await asyncio.to_thread(worker.start, partial(self.factory.prepare, name))
        return worker

    @staticmethod
    def _discard(worker: EngineWorker | None) -> None:
        """Close a worker that did not load; its process, if it has one, is waited for (so
        reaped) off the event loop."""
        if worker is None:
            return
        worker.close()
        asyncio.get_running_loop().run_in_executor(None, worker.loop.join, 30.0)

    async def _evict_one(self, keep: tuple[str, str], refuse: Callable[[], APIError],
                         give_up: float) -> None:
        """Unload the least recently used idle engine other than keep; when none is idle,
        raise refuse() (or, while an idle one was just handed to a request, wait a moment)."""
        idle = [(m, e) for m, e, w in self.loaded_workers() if (m, e) != keep and w.pending == 0]
        victim = self.residency.least_recent(idle, time.monotonic())
        if victim is None:
            if not idle or time.monotonic() > give_up:
                raise refuse()
            await asyncio.sleep(self.residency.grace_s / 4)
            return
        log.info("unloading %s from the %s engine to load %s", victim[0], victim[1], keep[0])
        await self._unload(victim)

    async def _make_room(self, key: tuple[str, str]) -> None:
        """Under max_loaded, unload the least recently used idle engine for key's; a 503 when
        every loaded one is serving."""
        give_up = time.monotonic() + 10 * self.residency.grace_s
        while self.max_loaded is not None:
            loaded = [k for k in ((m, e) for m, e, _ in self.loaded_workers()) if k != key]
            if len(loaded) < self.max_loaded:
                return
            count = len(loaded)
            await self._evict_one(key, lambda count=count: APIError(
                503, f"{count} engines are loaded (--max-loaded-models {self.max_loaded}) and each "
                f"is serving requests: '{key[0]}' cannot be loaded until one is done",
                type="server_error", code="model_unavailable"), give_up)

    def held_bytes(self) -> int:
        """What the loaded engines hold: their weights and KV caches."""
        return sum((w.engine.info.weights_bytes + w.engine.info.kv_cache_bytes)
                   // w.engine.info.devices
                   for _, _, w in self.loaded_workers() if w.engine is not None)

    async def _fit_budget(self, key: tuple[str, str], spec: ModelSpec) -> int | None:
        """Unload least recently used idle engines until key's fits the memory budget; the most
        KV cache it may then take (None: unchecked). A 503 naming the budget when busy engines
        hold what it needs."""
        if self.memory_budget is None:
            self.memory_budget = await asyncio.to_thread(self.factory.default_memory_budget)
            log.info("memory budget for weights and KV caches: %.1f GiB",
                     self.memory_budget / 2**30)
        try:
            est = await asyncio.to_thread(self.factory.estimate, key[1], spec)
        except EngineError:
            raise  # what the engine would refuse too (say, a format it does not serve)
        except Exception:
            # Unreadable files: the load that follows fails with the error to show.
            log.warning("cannot estimate the memory of %s; loading it unchecked", spec.id,
                        exc_info=True)
            return None
        if est.smallest_bytes > self.memory_budget:
            raise APIError(
                503, f"model '{spec.id}' needs {est.smallest_bytes / 2**30:.2f} GiB (weights and "
                f"one full context), more than the whole memory budget (--memory-budget "
                f"{self.memory_budget / 2**30:.2f} GiB)", type="server_error",
                code="model_unavailable")
        give_up = time.monotonic() + 10 * self.residency.grace_s
        while (free := self.memory_budget - self.held_bytes()) < est.smallest_bytes:
            await self._evict_one(key, lambda free=free: APIError(
                503, f"model '{spec.id}' needs {est.smallest_bytes / 2**30:.2f} GiB (weights "
                f"and one full context) and the memory budget (--memory-budget "
                f"{self.memory_budget / 2**30:.2f} GiB) has {max(free, 0) / 2**30:.2f} GiB "
                "free; the models loaded are serving requests", type="server_error",
                code="model_unavailable"), give_up)
        return free - est.weights_bytes

    async def _unload(self, key: tuple[str, str], timeout_s: float = 30.0) -> None:
        worker = self._workers.pop(key, None)
        self.residency.forget(key)
        if worker is None:
            return
        # Requests already admitted finish first; new ones load the model afresh.
        deadline = time.monotonic() + timeout_s
        while worker.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not await worker.aclose(timeout_s):
            log.warning("the %s engine of %s did not stop within %g s", key[1], key[0], timeout_s)

    async def unload(self, model_id: str, engine: str | None = None) -> list[str]:
        """Unload the model's engines (or the one named) once their requests are done; returns
        the engines unloaded."""
        spec = self.spec(model_id)
        keys = [k for k in list(self._workers) if k[0] == spec.id and engine in (None, k[1])]
        for key in keys:
            await self._unload(key)
        return [k[1] for k in keys]

    async def reap(self) -> list[tuple[str, str]]:
        """Unload every idle engine past its keep_alive; returns them."""
        idle = [k for k, w in list(self._workers.items()) if w.loaded and w.pending == 0]
        gone = self.residency.expired(idle, time.monotonic())
        for key in gone:
            log.info("unloading %s from the %s engine: idle past its keep_alive", *key)
            await self._unload(key)
        return gone

    async def reap_forever(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reap()
            except Exception:
                log.exception("unloading idle engines failed")

    def loaded_workers(self) -> list[tuple[str, str, EngineWorker]]:
        """(model id, engine name, worker) of every loaded engine."""
        return [(m, e, w) for (m, e), w in list(self._workers.items()) if w.loaded]

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Close every engine once its current decode step is done (at shutdown, cancelled
        generations stop there), waiting at most timeout_s for each."""
        workers, self._workers = list(self._workers.items()), {}
        for (model, engine), worker in workers:
            if not await worker.aclose(timeout_s):
                log.warning("the %s engine of %s did not stop within %g s", engine, model, timeout_s)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()


def tensor_parallel(spec: ModelSpec, server_default: int) -> int:
    """The ranks a model is split over: its own tensor_parallel, else the server's (generate
    models only)."""
    if spec.task != "generate":
        return 1
    return spec.tensor_parallel or server_default


class ProcessPolicy:
    """Whether a model's engine gets a process of its own (--engine-process): generating
    engines only (a classifier runs one request at a time); auto decides by the torch device,
    found on first use rather than at start-up (it imports torch). A tensor-parallel engine
    always has one: its ranks' processes end with it (torch_engine/ranks.py), never the
    server."""

    def __init__(self, mode: str, device: str, tensor_parallel_default: int = 1):
        wants_process(mode, "cpu")  # a mode that does not exist fails here, at start-up
        self.mode, self.device = mode, device
        self.tensor_parallel_default = tensor_parallel_default

    def __call__(self, spec: ModelSpec, engine: str) -> bool:
        return self._decide(spec, engine, lambda: choose_device(self.device))

    def likely(self, spec: ModelSpec, engine: str) -> bool:
        """The decision as far as it is made without importing torch: where the device is
        auto, a GPU the driver shows counts as CUDA (so a process started on the guess is
        rarely one too many: a CPU-only torch on a GPU machine)."""
        def guess() -> str:
            if self.device != "auto":
                return self.device
            return "cuda" if cuda_visible() else "cpu"

        return self._decide(spec, engine, guess)

    def _decide(self, spec: ModelSpec, engine: str, device: Callable[[], str]) -> bool:
        if spec.task != "generate":
            return False
        if engine == "torch" and tensor_parallel(spec, self.tensor_parallel_default) > 1:
            return True
        if self.mode != "auto":
            return wants_process(self.mode, self.device)
        if not backend_available("torch"):
            return False
        return wants_process(self.mode, device())


def _default_engine(spec: ModelSpec, requested: str) -> str:
    # Sequence-classification checkpoints run on the torch engine only, wherever we are.
    if spec.task == "classify" and requested == "auto":
        return "torch"
    return resolve_engine_name(requested)


def default_model_id(specs: list[ModelSpec], requested: str | None) -> str:
    if requested is None:
        return specs[0].id
    if requested not in {s.id for s in specs}:
        raise ValueError(f"model '{requested}' is not in the registry")
    return requested


