"""POST /v1/classifications over the fake engines: shape, zero-shot logic, limits, bad input."""

import math
import threading
import time

import pytest

from engines.fake import FakeEngine
from tests.server.helpers import CHAT, assert_openai_error

ZS = {"model": "tiny", "input": "I love this", "labels": ["love", "hate"]}


def test_zero_shot_response_shape_usage_and_metrics(client):
    resp = client.post("/v1/classifications", json={**ZS, "input": ["I love it", "I hate it"]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "classification" and body["id"].startswith("clf-")
    assert body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert [d["label"] for d in body["data"]] == ["love", "hate"]
    for d in body["data"]:
        assert [s["label"] for s in d["scores"]] == ["love", "hate"]  # the request's order
        assert math.isclose(sum(s["probability"] for s in d["scores"]), 1.0, rel_tol=1e-9)
        assert d["label"] == max(d["scores"], key=lambda s: s["probability"])["label"]
    # Calibrated: two inputs and the content-free one, each with the labels in both orders.
    calls = client.factory.engines["torch"].calls
    assert len(calls) == 6
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(c) for c in calls)
    assert usage["completion_tokens"] == 6 * (len(b"love\n") + len(b"hate\n"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    m = body["metrics"]
    assert m["engine"] == "torch" and m["classifications_per_s"] > 0 and m["total_ms"] > 0


def test_calibration_divides_out_the_content_free_prior(client):
    """The fake scores a label +3 for each time it occurs in the prompt; every prompt lists
    the labels once, so only calibration brings the text's own evidence to even odds."""
    body = client.post("/v1/classifications", json={**ZS, "input": "no label named"}).json()
    assert [s["probability"] for s in body["data"][0]["scores"]] == pytest.approx([0.5, 0.5])
    raw = client.post("/v1/classifications", json={**ZS, "calibrate": False}).json()
    p_love = raw["data"][0]["scores"][0]["probability"]
    assert p_love == pytest.approx(1 / (1 + math.exp(-3.0)))


def test_mean_scoring_divides_by_label_length(client):
    body = client.post("/v1/classifications", json={
        "model": "tiny", "input": "neutral", "labels": ["jj", "kkkk"], "calibrate": False,
        "label_scoring": "mean",
    }).json()
    # Each label is named once in the prompt (+3) and costs -1 a token, its newline included.
    scores = {s["label"]: s["logprob"] for s in body["data"][0]["scores"]}
    assert scores["jj"] == pytest.approx((3.0 - 3) / 3)
    assert scores["kkkk"] == pytest.approx((3.0 - 5) / 5)
    assert body["data"][0]["label"] == "jj"


def test_instruction_reaches_the_prompt(client):
    client.post("/v1/classifications", json={**ZS, "instruction": "Sort by mood."})
    prompt = bytes(client.factory.engines["torch"].calls[0]).decode()
    assert "Sort by mood." in prompt and "I love this" in prompt and "love, hate" in prompt


def test_classifier_checkpoint_uses_its_own_labels(client):
    body = client.post("/v1/classifications", json={"model": "sorter", "input": ["great!", "meh"]}).json()
    assert [d["label"] for d in body["data"]] == ["positive", "negative"]
    assert [s["label"] for s in body["data"][0]["scores"]] == ["negative", "positive"]
    assert body["data"][0]["scores"][1]["probability"] == pytest.approx(0.9)
    assert body["metrics"]["engine"] == "torch"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "input": "x"}, "labels"),                                  # zero-shot needs labels
    ({**ZS, "labels": []}, "labels"),
    ({**ZS, "labels": ["only"]}, "labels"),
    ({**ZS, "labels": ["a", "  "]}, "labels[1]"),
    ({**ZS, "labels": ["Yes", "no", "yes"]}, "labels[2]"),                     # case-insensitive
    ({**ZS, "labels": ["a", "b" * 101]}, "labels[1]"),
    ({**ZS, "labels": [str(i) for i in range(33)]}, "labels"),
    ({**ZS, "input": ""}, "input"),
    ({**ZS, "input": []}, "input"),
    ({**ZS, "input": ["fine", " "]}, "input[1]"),
    ({**ZS, "input": ["x"] * 257}, "input"),
    ({**ZS, "input": 5}, "input"),
    ({**ZS, "label_scoring": "max"}, "label_scoring"),
    ({"model": "sorter", "input": "x", "labels": ["a", "b"]}, "labels"),        # has its own
    ({"model": "sorter", "input": "x", "instruction": "hm"}, "instruction"),
    ({"model": "sorter", "input": "x", "calibrate": True}, "calibrate"),
    ({"model": "sorter", "input": "x", "engine": "mlx"}, "engine"),
])
def test_bad_input_is_a_400_naming_the_field(client, body, param):
    assert_openai_error(client.post("/v1/classifications", json=body), 400, param=param)


def test_unknown_model_is_a_404(client):
    assert_openai_error(client.post("/v1/classifications", json={**ZS, "model": "nope"}), 404,
                        code="model_not_found")


def test_limits_come_from_settings(make_client):
    with make_client(max_classification_inputs=2, max_classification_labels=3,
                     max_label_chars=4) as c:
        assert_openai_error(c.post("/v1/classifications", json={**ZS, "input": ["a"] * 3}), 400, "input")
        assert_openai_error(c.post("/v1/classifications", json={**ZS, "labels": ["a", "b", "c", "d"]}),
                            400, "labels")
        assert_openai_error(c.post("/v1/classifications", json={**ZS, "labels": ["a", "bbbbb"]}),
                            400, "labels[1]")
        assert c.post("/v1/classifications", json={**ZS, "input": ["a", "b"]}).status_code == 200


def test_a_too_long_input_is_a_400_and_the_engine_still_serves(make_client, models_file):
    with make_client() as c:  # the fake's context is 512 bytes
        err = assert_openai_error(c.post("/v1/classifications", json={**ZS, "input": "x" * 600}),
                                  400, param="input", code="context_length_exceeded")
        assert "512" in err["message"]
        assert c.post("/v1/classifications", json=ZS).status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_classify_model_cannot_chat_and_generation_model_needs_labels(client):
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "model": "sorter"}), 400,
                        param="model")
    assert_openai_error(client.post("/v1/classifications", json={"model": "tiny", "input": "x"}), 400,
                        param="labels")


def test_a_classification_runs_beside_a_running_generation(make_client):
    """A classification sent while a slow generation runs does not wait for the whole
    generation, nor the generation for it: the generation takes its steps between two prompts
    of the classification's scoring."""
    from tests.server.conftest import FakeFactory

    factory = FakeFactory(token_delay_s=0.01)
    with make_client(factory) as c:
        engine: FakeEngine = factory.engines["torch"]
        done = {}

        def generate():
            done["chat"] = c.post("/v1/chat/completions", json=CHAT)

        t = threading.Thread(target=generate)
        t.start()
        # The generation has started producing tokens (a bounded wait: a hang fails, not stalls).
        started = time.monotonic()
        while not engine.trace:
            assert time.monotonic() - started < 10, "the generation never started"
            time.sleep(0.005)
        resp = c.post("/v1/classifications", json=ZS)
        t.join()
        assert resp.status_code == 200 and done["chat"].status_code == 200
        kinds = [token == "score" for _, token in engine.trace]
        first_score, last_score = kinds.index(True), len(kinds) - 1 - kinds[::-1].index(True)
        assert not all(kinds[first_score : last_score + 1])  # tokens came between the prompts
        assert not kinds[0] and not kinds[-1]  # the generation had begun and went on after
