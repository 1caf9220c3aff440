"""Every thread's Python stack printed when the process crashes in native code.

Why: a segfault or abort in a compiler, a driver or a tokenizer ends a process with only its
exit code; faulthandler prints where each thread was first, on the process's stderr (the
server's log). Used by duet's server process, engine processes and tensor-parallel ranks."""

from __future__ import annotations

import faulthandler
import logging

log = logging.getLogger("duet.crash")


def enable() -> bool:
    """faulthandler on, where there is a stderr to write to (a daemon's may be closed, or be
    no file); returns whether it is on."""
    try:
        faulthandler.enable()
    except (RuntimeError, OSError, ValueError, AttributeError) as exc:
        log.debug("no stacks on a crash: %s", exc)
        return False
    return True
