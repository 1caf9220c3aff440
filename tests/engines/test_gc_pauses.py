"""The garbage collector's pauses, timed, and freezing what a loaded engine holds."""

import gc
import logging
import os
import subprocess
import sys
import textwrap

from engines import gc_pauses


def test_each_collection_is_timed_by_generation_and_the_long_ones_are_logged(caplog):
    ticks = iter([10.0, 10.004, 20.0, 20.05])
    pauses = gc_pauses.Pauses(log_over_s=0.01, clock=lambda: next(ticks))
    with caplog.at_level(logging.INFO, logger="duet.gc"):
        pauses("start", {"generation": 0})
        pauses("stop", {"generation": 0, "collected": 3})
        pauses("start", {"generation": 2})
        pauses("stop", {"generation": 2, "collected": 7})
    young, _, old = pauses.by_generation
    assert (young.collections, round(young.longest_s, 6)) == (1, 0.004)
    assert (old.collections, round(old.total_s, 6)) == (1, 0.05)
    assert len(caplog.records) == 1  # only the 50 ms one
    assert "generation-2" in caplog.text and "50.0 ms" in caplog.text


def test_watch_installs_one_callback_that_sees_real_collections():
    pauses = gc_pauses.watch()
    try:
        assert gc_pauses.watch() is pauses
        assert sum(isinstance(c, gc_pauses.Pauses) for c in gc.callbacks) == 1
        before = pauses.by_generation[2].collections
        gc.collect()
        assert pauses.by_generation[2].collections == before + 1
    finally:
        gc.callbacks.remove(pauses)


def test_frozen_objects_are_left_out_of_collections():
    """In a process of its own: a freeze is for good (the test process must not keep its
    garbage)."""
    code = textwrap.dedent("""
        import gc
        from engines import gc_pauses
        kept = [[i] for i in range(50_000)]
        frozen = gc_pauses.freeze("test")
        assert frozen >= 50_000, frozen
        tracked = len(gc.get_objects())
        assert tracked < 50_000, tracked  # the frozen lists are no generation's any more
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=".", timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_oldest_generation_is_held_until_every_hold_is_released():
    saved = gc.get_threshold()
    gc_pauses.hold_oldest()
    try:
        gc_pauses.hold_oldest()  # a second engine compiling at once
        assert gc.get_threshold() == (saved[0], saved[1], gc_pauses.HELD)
        gc_pauses.release()
        assert gc.get_threshold()[2] == gc_pauses.HELD
    finally:
        gc_pauses.release()
    assert gc.get_threshold() == saved


def test_a_start_up_holds_the_oldest_generation_unless_the_collector_is_left_alone(
        monkeypatch):
    saved = gc.get_threshold()
    monkeypatch.setenv("DUET_GC_FREEZE", "1")
    with gc_pauses.held():
        assert gc.get_threshold() == (saved[0], saved[1], gc_pauses.HELD)
    assert gc.get_threshold() == saved
    try:
        with gc_pauses.held():
            raise ValueError("a load that fails")
    except ValueError:
        pass
    assert gc.get_threshold() == saved
    monkeypatch.setenv("DUET_GC_FREEZE", "0")
    with gc_pauses.held():
        assert gc.get_threshold() == saved


def test_a_load_is_settled_and_a_compile_beside_holds_the_oldest_generation_till_it_comes():
    """In a process of its own, with DUET_GC_FREEZE=1 (the suite runs with 0)."""
    code = textwrap.dedent("""
        import gc
        from concurrent.futures import Future
        from engines import gc_pauses
        usual = gc.get_threshold()
        gc_pauses.settle("loaded, no compile", None)
        first = gc.get_freeze_count()
        assert first > 0 and gc.get_threshold() == usual
        compiled = Future()
        gc_pauses.settle("loaded", compiled)
        assert gc.get_threshold()[2] == gc_pauses.HELD
        made = [[i] for i in range(20_000)]  # the compile's objects
        compiled.set_result(None)
        assert gc.get_threshold() == usual
        assert gc.get_freeze_count() >= first + 20_000
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "DUET_GC_FREEZE": "1"})
    assert out.stdout.strip() == "ok", out.stderr


def test_the_suite_runs_without_freezing():
    gc_pauses.settle("a test's engine", None)
    assert not gc_pauses.freezing_wanted()
    assert gc.get_freeze_count() == 0


def test_an_engine_frozen_at_its_load_is_freed_when_closed(tiny_dirs):
    """Frozen objects are never collected: a closed engine's weights must go by reference
    counts alone, or every unload under DUET_GC_FREEZE=1 would keep them (in a process of its
    own, the collector off after the load so a collection cannot hide a cycle)."""
    code = textwrap.dedent(f"""
        import gc, threading, weakref
        from engines.base import RequestStats, SamplingParams
        from engines.runtime.loop import EngineLoop
        from engines.runtime.runtime import Submission
        from engines.torch_engine import TorchEngine
        loop = EngineLoop("t")
        engine = loop.load(lambda: TorchEngine({str(tiny_dirs["llama"][0])!r}, context_length=96,
                                               dtype="float32", device="cpu")).result()
        assert gc.get_freeze_count() > 0
        weight = weakref.ref(next(engine.model.parameters()))
        done = threading.Event()
        loop.add(Submission([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0),
                            lambda e: isinstance(e, (RequestStats, Exception)) and done.set()))
        assert done.wait(60)
        gc.disable()
        loop.close(engine)
        assert loop.join(30)
        del engine, loop
        assert weight() is None, "the closed engine's weights are still alive"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "DUET_GC_FREEZE": "1"})
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_runtimes_status_counts_its_processs_collections():
    """What /health shows of an engine (and the load mode reads per level): the time its
    process spent in collections, and how many of the oldest generation."""
    from engines.fake import FakeEngine
    from engines.runtime.runtime import Runtime

    runtime = Runtime(FakeEngine("fake", max_batch=2))
    before = runtime.status()
    gc.collect()
    after = runtime.status()
    assert after.gc_oldest_collections == before.gc_oldest_collections + 1
    assert after.gc_pause_s > before.gc_pause_s
