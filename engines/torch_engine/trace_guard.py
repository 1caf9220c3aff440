"""Eager forwards kept apart from torch.fx's tracing on another thread.

Why: torch.fx's Tracer.trace, which torch.compile uses (make_fx, so AOTAutograd, and
Inductor's pattern passes), replaces torch.nn.Module.__call__ and __getattr__ for the whole
process while it traces. A module called meanwhile on another thread goes through the tracer:
on an H100 (2026-11-27) a request's prefill, run eagerly while the engine's decode step was
compiled beside it on a machine's first start, failed with the tracer's NameError "module is
not installed as a submodule" (a 500). install() makes every trace hold one lock, process-wide
as the patching it guards is; the torch engine's serving thread holds it (eager()) around the
forwards it runs through modules. A prefill that arrives during a trace then waits for its end:
first starts only, since a warm start's compile reads AOTAutograd's and Inductor's caches and
traces nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading

log = logging.getLogger("duet.engines.torch")

_LOCK = threading.RLock()  # reentrant: a trace may nest another; scoring runs steps inside
_guarded = None  # the wrapper install() put in place


def install() -> bool:
    """Every torch.fx trace from now on holds the lock; False where this torch's tracer has
    no patcher to wrap (its forwards then go unguarded, as before)."""
    global _guarded
    try:
        from torch.fx import _symbolic_trace as fx_trace

        patcher = fx_trace._new_patcher
    except (ImportError, AttributeError) as exc:
        log.warning("torch.fx's tracer could not be guarded (%s): an eager forward during a "
                    "compile may fail", exc)
        return False
    if patcher is _guarded:
        return True

    @contextlib.contextmanager
    def guarded():
        with _LOCK, patcher() as active:
            yield active

    _guarded = guarded
    fx_trace._new_patcher = guarded
    return True


def eager() -> threading.RLock:
    """Held around a forward through modules: no trace patches them meanwhile."""
    return _LOCK
