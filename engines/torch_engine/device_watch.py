"""A device that never finishes a step ends the engine's process, instead of holding its
requests, and every request after them, for ever.

Why: on an H100 (2026-11-27), 4 of 8 first starts with a stream running while the compiled
step was made never answered again: the serving thread waited on its step's read-back event
for minutes (py-spy's native stacks in docs/bench/start-cold-hang-stacks-h100-2026-11-27.txt)
while the GPU ran at 100% on a step that never ended. The cause was found and removed
(CudaGraphs: two GEMMs on one cuBLAS workspace); this watch stays for whatever else would
hang a device. A step's tokens come back in milliseconds, a long prefill chunk's in seconds; a
wait past DEVICE_WAIT_LIMIT_S is a device that will not finish. The process then prints every
thread's stack and exits: its requests end with an error, and the server loads the model anew
at the next request (in an engine process, the default on CUDA; with --engine-process off the
process is the server's). scripts/check_device_watch.py runs it against a kernel that
never ends, on a GPU."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("duet.engines.torch")

DEVICE_WAIT_LIMIT_S = float(os.environ.get("DUET_DEVICE_WAIT_LIMIT_S", "60"))


class DeviceWatch:
    """Watches one thread's waits on the device (waiting()); on_stuck(why) runs, once, on a
    watcher thread, when one outlasts limit_s."""

    def __init__(self, limit_s: float = DEVICE_WAIT_LIMIT_S,
                 on_stuck: Callable[[str], None] | None = None):
        self.limit_s = limit_s
        self.on_stuck = on_stuck or stop_process
        self._since: float | None = None
        self._what = ""
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="duet-device-watch",
                                            daemon=True)
            self._thread.start()
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.limit_s / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.limit_s:
                self.on_stuck(f"{self._what} waited more than {self.limit_s:g} s for the device")
                return


def stop_process(why: str) -> None:
    """Every thread's stack to stderr (the log), then the process ends."""
    log.error("%s: the device does not finish its work; the engine's process stops", why)
    with contextlib.suppress(Exception):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    logging.shutdown()
    os._exit(70)
