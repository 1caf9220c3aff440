"""Which loaded engines may be unloaded: each one's last request and keep_alive deadline.

The registry asks this bookkeeping, which holds no engines itself. An engine is unloaded only
when idle (no request admitted or waiting) and asked for no sooner than grace_s ago: a request
that has just been handed its worker, and is still making its prompt, is not yet counted by
the worker, and must not find it closed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

GRACE_S = 2.0


class Residency:
    def __init__(self, default_keep_alive_s: float | None, grace_s: float = GRACE_S):
        self.default_keep_alive_s = default_keep_alive_s
        self.grace_s = grace_s
        self._last_used: dict[Hashable, float] = {}
        self._expires: dict[Hashable, float | None] = {}

    def used(self, key: Hashable, keep_alive_s: float | None, now: float) -> None:
        """A request asked for key's engine; it stays keep_alive_s past now (None: for good).
        Each request sets the deadline anew, as in Ollama."""
        self._last_used[key] = now
        self._expires[key] = None if keep_alive_s is None else now + keep_alive_s

    def forget(self, key: Hashable) -> None:
        self._last_used.pop(key, None)
        self._expires.pop(key, None)

    def _settled(self, key: Hashable, now: float) -> bool:
        return now - self._last_used.get(key, float("-inf")) >= self.grace_s

    def expired(self, idle: Iterable[Hashable], now: float) -> list[Hashable]:
        """Of the idle engines, those past their keep_alive."""
        out = []
        for key in idle:
            deadline = self._expires.get(key)
            if deadline is not None and now >= deadline and self._settled(key, now):
                out.append(key)
        return out

    def least_recent(self, idle: Iterable[Hashable], now: float) -> Hashable | None:
        """The idle engine asked for longest ago (the one to unload for another), if any."""
        settled = [k for k in idle if self._settled(k, now)]
        return min(settled, key=lambda k: self._last_used.get(k, float("-inf")), default=None)

    def describe(self, key: Hashable, now: float) -> dict:
        deadline = self._expires.get(key)
        last = self._last_used.get(key)
        return {"idle_s": None if last is None else round(now - last, 3),
                "unloads_in_s": None if deadline is None else round(max(0.0, deadline - now), 3)}
