"""A tiny random *ForSequenceClassification checkpoint, saved the way transformers saves one,
served through the app on the torch engine: probabilities equal transformers' softmax."""

import pytest
import torch
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.server.helpers import assert_openai_error

WORDS = "the film was great awful boring fun and i loved hated it plot acting".split()
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["the film was great fun", "i hated it", "boring plot and awful acting and it was boring"]


def _tokenizer(path):
    from transformers import BertTokenizerFast

    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def _config(family):
    import transformers as tf

    common = dict(vocab_size=len(WORDS) + 5, num_labels=3, id2label=LABELS,
                  label2id={v: k for k, v in LABELS.items()}, pad_token_id=0,
                  max_position_embeddings=64)
    if family == "bert":
        return tf.BertConfig(**common, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64)
    if family == "distilbert":
        return tf.DistilBertConfig(**common, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    return tf.RobertaConfig(**common, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64)


@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta"])
def test_served_probabilities_equal_transformers_softmax(tmp_path, family):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model_dir = tmp_path / family
    model_dir.mkdir()
    model = AutoModelForSequenceClassification.from_config(_config(family)).eval()
    model.save_pretrained(model_dir)
    tok = _tokenizer(model_dir)
    tok.save_pretrained(model_dir)
    registry = tmp_path / "models.toml"
    registry.write_text(f'[[models]]\nid = "clf"\nsource = "path:{model_dir}"\ntask = "classify"\n'
                        f'dtype = "float32"\n')
    with TestClient(create_app(Settings(models_file=registry, device="cpu"))) as client:
        resp = client.post("/v1/classifications", json={"model": "clf", "input": TEXTS})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        for text, item in zip(TEXTS, body["data"]):
            with torch.no_grad():
                expected = torch.softmax(model(**tok(text, return_tensors="pt")).logits[0], -1)
            got = [s["probability"] for s in item["scores"]]
            assert [s["label"] for s in item["scores"]] == list(LABELS.values())
            torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=1e-4)
            assert item["label"] == LABELS[int(expected.argmax())]
        real_tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS)
        assert body["usage"]["prompt_tokens"] == real_tokens
        assert body["metrics"]["engine"] == "torch"
        # Wrong way round: chat on a classifier, labels for a classifier.
        assert_openai_error(client.post("/v1/chat/completions", json={
            "model": "clf", "messages": [{"role": "user", "content": "hi"}]}), 400, param="model")
        assert_openai_error(client.post("/v1/classifications", json={
            "model": "clf", "input": "x", "labels": ["a", "b"]}), 400, param="labels")
        too_long = " ".join(["great"] * 80)
        assert_openai_error(client.post("/v1/classifications", json={"model": "clf", "input": too_long}),
                            400, param="input", code="context_length_exceeded")
        card = client.get("/v1/models/clf").json()
        assert card["task"] == "classify" and card["default_engine"] == "torch"


def test_a_causal_lm_registered_as_classify_is_a_clear_error(tmp_path, tiny_dirs):
    registry = tmp_path / "models.toml"
    registry.write_text(f'[[models]]\nid = "clf"\nsource = "path:{tiny_dirs["llama"][0]}"\n'
                        f'task = "classify"\n')
    with TestClient(create_app(Settings(models_file=registry, device="cpu", preload=False))) as c:
        err = assert_openai_error(c.post("/v1/classifications", json={"model": "clf", "input": "x"}),
                                  400, param="model")
        assert "ForSequenceClassification" in err["message"]
