"""Python's garbage collector, timed, and kept off what a loaded engine holds for good.

Why: a collection of the oldest generation walks every object the process tracks, and a
process that loaded a model and compiled its decode step tracks millions (Dynamo's guards and
graphs, Inductor's code, the tokenizer's tables) that live as long as it does. Each such
collection stops the thread that triggered it, a step's thread or the HTTP event loop, for as
long as the walk takes. gc.freeze() moves every object tracked at that moment into a permanent
generation that collections skip (CPython's advice for servers, and what vLLM does after its
start-up); `freeze` is called once a model is loaded and again when its compiled step arrives,
so only what serving allocates since is ever walked. While the compiled step is made beside
the serving steps, the oldest generation is not collected at all (`hold_oldest`): the compile's
own objects, millions, would be walked by each such collection (measured in an int8 8B engine
process on an H100, 2026-11-27: 27 ms growing to 781 ms as the compile went on, 1.4 s once after
it without the freezes; the streams served meanwhile stalled for as long). The young
generations are still collected, which frees most of a compile's garbage; what reaches the
oldest meanwhile is frozen with the compiled step, never freed (some hundred thousand objects,
once). `Pauses` times every collection, so a pause is seen, not guessed: the long ones are
logged, and its counts kept by generation."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field

log = logging.getLogger("duet.gc")

# Collections at least this long are logged (a decode step of a small model on a GPU is ~1 ms).
LOG_OVER_S = 0.01
# The oldest generation's threshold while it is held: CPython collects a generation once its
# count passes the threshold, and this count (collections of the generation below) never does.
HELD = 1 << 30


@dataclass
class GenerationPauses:
    collections: int = 0
    total_s: float = 0.0
    longest_s: float = 0.0


@dataclass
class Pauses:
    """A gc.callbacks entry: each collection's time, by generation."""

    log_over_s: float = LOG_OVER_S
    clock: Callable[[], float] = time.perf_counter
    by_generation: list[GenerationPauses] = field(
        default_factory=lambda: [GenerationPauses() for _ in range(3)])
    _started: float | None = None
    # Holds of the oldest generation (engines compiling at once, each released on its compile's
    # thread) and the thresholds before them.
    holds: int = 0
    saved: tuple[int, int, int] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        if self._started is None:  # installed mid-collection
            return
        took, self._started = self.clock() - self._started, None
        gen = self.by_generation[info["generation"]]
        gen.collections += 1
        gen.total_s += took
        gen.longest_s = max(gen.longest_s, took)
        if took >= self.log_over_s:
            log.info("a generation-%d garbage collection took %.1f ms (%d objects freed, "
                     "%d kept out of collections by gc.freeze)", info["generation"],
                     took * 1000, info["collected"], gc.get_freeze_count())


def watch() -> Pauses:
    """This process's Pauses, installed on first use (one per process: gc.callbacks is)."""
    for callback in gc.callbacks:
        if isinstance(callback, Pauses):
            return callback
    pauses = Pauses()
    gc.callbacks.append(pauses)
    # Objects still frozen at exit are never finalized: nanobind's (Triton's, MLX's) then report
    # themselves leaked, line after line, on every shutdown (a no-op where nothing was frozen).
    atexit.register(gc.unfreeze)
    return pauses


def freeze(what: str) -> int:
    """Every object tracked now out of future collections (O(1): CPython splices its lists);
    returns how many are frozen in all. Garbage among them is never freed, so this runs after a
    load or a compile, whose garbage is small beside what they keep."""
    watch()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects kept out of garbage collections", what, frozen)
    return frozen


def hold_oldest() -> None:
    """No automatic collection of the oldest generation until every hold is released (several
    engines may compile at once); the young generations go on."""
    pauses = watch()
    with pauses.lock:
        if pauses.holds == 0:
            pauses.saved = gc.get_threshold()
            gc.set_threshold(pauses.saved[0], pauses.saved[1], HELD)
        pauses.holds += 1


def release() -> None:
    pauses = watch()
    with pauses.lock:
        pauses.holds -= 1
        if pauses.holds == 0 and pauses.saved is not None:
            gc.set_threshold(*pauses.saved)
            pauses.saved = None


@contextmanager
def held() -> Iterator[None]:
    """The oldest generation held (hold_oldest) for the block: a start-up's. Its imports and load
    make millions of objects that live for good, and each collection of the oldest generation
    meanwhile walks all that came before it (on a 2-core CPU, torch's, transformers' and
    Inductor's imports alone met ten of them, 1.2 s). Not with DUET_GC_FREEZE=0."""
    if not freezing_wanted():
        yield
        return
    hold_oldest()
    try:
        yield
    finally:
        release()


def freezing_wanted() -> bool:
    """DUET_GC_FREEZE: 1 (the default) freezes; 0 leaves the collector as it is (the test suite,
    which runs hundreds of engines in one process, whose garbage a freeze would keep)."""
    return os.environ.get("DUET_GC_FREEZE", "1") != "0"


def settle(what: str, compiled: Future | None) -> None:
    """After a load: its garbage collected, then everything tracked frozen; if a compiled step
    is still being made beside (`compiled`), the oldest generation held until it comes, then
    frozen again (no collection first: it would stall the steps serving by then)."""
    if not freezing_wanted():
        return
    gc.collect()
    freeze(what)
    if compiled is None or compiled.done():
        return
    hold_oldest()

    def made(_) -> None:
        freeze(f"{what}, its compiled step made")
        release()

    compiled.add_done_callback(made)
