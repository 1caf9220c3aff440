"""keep_alive, as Ollama has it: how long a model stays loaded after a request asked for it."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_keep_alive(value: str | float) -> float | None:
    """Seconds, or None to keep the model loaded: a number of seconds or a duration such as
    "30s", "5m", "1h30m"; 0 unloads it once the request is done, a negative value keeps it."""
    if isinstance(value, bool):
        raise ValueError("keep_alive is a duration, not a boolean")
    if isinstance(value, (int, float)):
        return None if value < 0 else float(value)
    text = value.strip()
    try:
        return parse_keep_alive(float(text))
    except ValueError:
        pass
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive '{value}' is not a duration (such as 30s, 5m, 1h30m, 0 "
                         f"or -1)")
    if text.startswith("-"):
        return None
    return sum(float(n) * _UNITS[u] for n, u in parts)
