"""keep_alive durations (engines/keep_alive.py), as Ollama reads them."""

import pytest

from engines.keep_alive import parse_keep_alive
from engines.models.config import ModelSpec


@pytest.mark.parametrize("value,seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("30s", 30.0), ("250ms", 0.25), ("1.5h", 5400.0),
    ("0", 0.0), (0, 0.0), (12, 12.0), ("12", 12.0), (2.5, 2.5),
    ("-1", None), (-1, None), ("-5m", None),
])
def test_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "5x", "m5", "5m3", "forever", "1h 30m", True])
def test_what_is_not_a_duration(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_models_toml_keep_alive_is_checked_at_start_up():
    assert ModelSpec(id="m", source="dummy:llama-3.2-1b", keep_alive="10m").keep_alive == "10m"
    with pytest.raises(ValueError, match="not a duration"):
        ModelSpec(id="m", source="dummy:llama-3.2-1b", keep_alive="10 minutes")
