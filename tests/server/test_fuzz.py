"""Schemathesis against the app's own OpenAPI schema: every operation it lists, valid and invalid
inputs, at least 500 cases in all. No 5xx, and every error in the OpenAI shape.

Operations come from the schema, so endpoints added later are fuzzed without touching this
file. The fake engine keeps it fast; derandomize makes every run generate the same cases."""

import json

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from server.app import create_app
from server.settings import Settings
from tests.server.conftest import FakeFactory

CASES_PER_OPERATION_AND_MODE = 60
MIN_TOTAL = 500


def with_served_model(pair):
    """Random model names are all 404s; point most cases at the served models instead, so the
    generation paths get fuzzed too (whatever endpoint takes a 'model')."""
    case, model = pair
    if model is not None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        if case.path_parameters and "model_id" in case.path_parameters:
            case.path_parameters["model_id"] = model
    return case


def check_response(case, response) -> None:
    where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        body = json.loads(response.text)
        assert set(body) == {"error"}, where
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str), where


def fuzz_operation(operation, mode, statuses: dict[int, int]) -> int:
    """Run one operation's cases in one generation mode; returns how many ran."""
    ran = 0

    @settings(max_examples=CASES_PER_OPERATION_AND_MODE, derandomize=True, database=None,
              deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=st.tuples(operation.as_strategy(generation_mode=mode),
                          st.sampled_from(["tiny", "tiny", "tiny", "sorter", "embedder", None]))
           .map(with_served_model))
    def fuzz(case):
        nonlocal ran
        ran += 1
        response = case.call()
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_response(case, response)

    try:
        fuzz()
    except Unsatisfiable:
        # An operation without inputs (GET /health) has nothing to make invalid.
        assert mode is GenerationMode.NEGATIVE and ran == 0, operation.label
    return ran


def test_fuzz_every_operation_of_the_openapi_schema(models_file):
    app = create_app(Settings(models_file=models_file, preload=False), FakeFactory())
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    statuses: dict[int, int] = {}
    counts = {f"{op.label} [{mode.value}]": fuzz_operation(op, mode, statuses)
              for op in operations for mode in GenerationMode}
    assert {op.label.split(" ", 1)[1] for op in operations} >= {
        "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}
    assert sum(counts.values()) >= MIN_TOTAL, counts
    # Both kinds of outcome were exercised: answers and refusals.
    assert statuses.get(200, 0) >= 100 and statuses.get(400, 0) >= 100, statuses
    body_operations = [label for label in counts if label.startswith("POST")]
    assert all(counts[label] >= CASES_PER_OPERATION_AND_MODE // 2 for label in body_operations), counts
