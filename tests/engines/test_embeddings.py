"""Embed models on both engines: our BERT encoders on tiny random checkpoints against
transformers' BertModel with the model's pooling and normalisation; batching, truncation,
token-id inputs, stopping, and the sentence-transformers settings they read."""

import json
import threading

import numpy as np
import pytest

from engines.base import Cancelled, EmbedParams, UnsupportedModel
from engines.bert_config import duet_name
from engines.factory import create_engine
from engines.sentence_config import read_sentence_config
from tests.tiny_bert import SPARE_ROWS, VOCAB, make_tiny_bert, reference_embeddings

ENGINES = ["torch", "mlx"]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog",
         "cat sat on the mat!", "dogs", "x"]
LONG = " ".join(["the quick brown fox"] * 20)  # 80 words: past the 24 tokens kept
# (pooling, normalize, hidden_act): sentence-transformers' usual, and the other kinds.
KINDS = {"mean": ("mean", True, "gelu"), "cls": ("cls", False, "gelu_new")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = {}
    for kind, (pooling, normalize, act) in KINDS.items():
        path = tmp_path_factory.mktemp(f"tiny-bert-{kind}")
        model = make_tiny_bert(path, pooling=pooling, normalize=normalize, hidden_act=act)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="module")
def engines(tiny):
    """One loaded engine per (engine, kind), built on first use."""
    made = {}

    def get(name, kind="mean"):
        if name == "mlx":
            pytest.importorskip("mlx_lm")
        if (name, kind) not in made:
            made[name, kind] = create_engine(name, tiny[kind][0], context_length=4096,
                                             dtype="float32", task="embed")
        return made[name, kind]

    return get


def embed(engine, inputs, **kw):
    return engine.embed(EmbedParams(tuple(inputs)), **kw)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", ENGINES)
def test_vectors_match_transformers_bert_with_pooling(engines, tiny, name, kind):
    pooling, normalize, _ = KINDS[kind]
    path, model = tiny[kind]
    texts = [*TEXTS, LONG]
    got = embed(engines(name, kind), texts)
    want = reference_embeddings(model, path, texts, pooling=pooling, normalize=normalize)
    assert got.vectors.shape == (len(texts), 32) and got.vectors.dtype == np.float32
    np.testing.assert_allclose(got.vectors, want, atol=2e-5, rtol=1e-4)
    norms = np.linalg.norm(got.vectors, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize
    assert got.normalized == normalize


@pytest.mark.parametrize("name", ENGINES)
def test_an_input_alone_equals_it_in_a_batch_of_longer_ones(engines, name):
    engine = engines(name)
    batch = embed(engine, [LONG, "hello world", TEXTS[1], "x", TEXTS[2]]).vectors
    for i, text in [(1, "hello world"), (3, "x"), (2, TEXTS[1])]:
        alone = embed(engine, [text]).vectors[0]
        np.testing.assert_allclose(batch[i], alone, atol=1e-5)


@pytest.mark.parametrize("name", ENGINES)
def test_many_inputs_keep_their_order_across_batches(engines, name, monkeypatch):
    import engines.embed as embed_module

    monkeypatch.setattr(embed_module, "BATCH_TOKENS_FIRST", 8)
    monkeypatch.setattr(embed_module, "BATCH_TOKENS_MAX", 40)  # several batches
    engine = engines(name)
    texts = [TEXTS[i % len(TEXTS)] + " " + "dog " * (i % 4) for i in range(17)]
    many = embed(engine, texts).vectors
    for i in (0, 5, 16):
        np.testing.assert_allclose(many[i], embed(engine, [texts[i]]).vectors[0], atol=1e-5)


@pytest.mark.parametrize("name", ENGINES)
def test_long_inputs_are_truncated_and_counted(engines, tiny, name):
    from transformers import AutoTokenizer

    engine = engines(name)
    result = embed(engine, [LONG, "hello world"])
    assert engine.max_tokens == 24 and result.tokens == (24, 4)
    assert result.stats.prompt_tokens == 28 and result.stats.engine == name
    # Its ids, the text's own tokens without [CLS]/[SEP], are framed and cut the same way.
    tok = AutoTokenizer.from_pretrained(str(tiny["mean"][0]))
    ids = tuple(tok(LONG, add_special_tokens=False)["input_ids"])
    by_ids = embed(engine, [ids, tuple(tok("hello world", add_special_tokens=False)["input_ids"])])
    np.testing.assert_allclose(by_ids.vectors, result.vectors, atol=1e-6)
    assert by_ids.tokens == (24, 4)


@pytest.mark.parametrize("name", ENGINES)
def test_a_stop_is_heard_between_batches(engines, name):
    with pytest.raises(Cancelled):
        embed(engines(name), TEXTS, should_stop=lambda: True)


def test_concurrent_callers_each_get_their_own_vectors(engines):
    engine = engines("torch")
    want = {t: embed(engine, [t]).vectors[0] for t in TEXTS}
    got, errors = {}, []

    def call(text):
        try:
            for _ in range(3):
                got[text] = embed(engine, [text, LONG]).vectors[0]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(t,)) for t in TEXTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for text in TEXTS:
        np.testing.assert_allclose(got[text], want[text], atol=1e-5)


def test_info_says_task_dimension_and_pooling(engines):
    engine = engines("torch")
    assert (engine.dimension, engine.vocab_size, engine.max_tokens) == (
        32, len(VOCAB) + SPARE_ROWS, 24)
    assert engine.info.extra["task"] == "embed" and engine.info.extra["pooling"] == "mean"
    assert engine.info.context_length == 24


def test_context_length_shortens_what_an_input_keeps(tiny):
    engine = create_engine("torch", tiny["mean"][0], context_length=16, dtype="float32",
                           task="embed")
    assert engine.max_tokens == 16 and embed(engine, [LONG]).tokens == (16,)


def _rewrite(path, name, change):
    data = json.loads((path / name).read_text())
    change(data)
    (path / name).write_text(json.dumps(data))


def test_unsupported_pooling_and_modules_are_refused_by_name(tmp_path):
    make_tiny_bert(tmp_path, pooling="max")
    with pytest.raises(UnsupportedModel, match="pooling max is not supported.*'mean' or 'cls'"):
        create_engine("torch", tmp_path, context_length=64, task="embed")
    _rewrite(tmp_path, "1_Pooling/config.json", lambda c: c.update(
        pooling_mode_max_tokens=False, pooling_mode_mean_tokens=True))
    _rewrite(tmp_path, "modules.json", lambda m: m.append(
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}))
    with pytest.raises(UnsupportedModel, match="module 'Dense'"):
        create_engine("torch", tmp_path, context_length=64, task="embed")
    _rewrite(tmp_path, "config.json", lambda c: c.update(model_type="roberta"))
    with pytest.raises(UnsupportedModel, match="BERT encoder.*'roberta'"):
        create_engine("mlx" if _has_mlx() else "torch", tmp_path, context_length=64,
                      task="embed")


def _has_mlx():
    import importlib.util

    return importlib.util.find_spec("mlx_lm") is not None


def test_a_plain_bert_directory_pools_by_mean_without_normalising(tmp_path):
    config = read_sentence_config(tmp_path, max_positions=512)
    assert (config.pooling, config.normalize, config.max_tokens) == ("mean", False, 512)


def test_checkpoint_names_map_onto_the_encoders():
    assert duet_name("encoder.layer.3.attention.self.query.weight") == "layers.3.query.weight"
    assert duet_name("bert.encoder.layer.0.output.LayerNorm.gamma") == "layers.0.ffn_norm.weight"
    assert duet_name("embeddings.word_embeddings.weight") == "embeddings.word.weight"
    assert duet_name("encoder.layer.1.attention.output.dense.bias") == "layers.1.attn_out.bias"
    for unused in ("pooler.dense.weight", "embeddings.position_ids", "classifier.weight"):
        assert duet_name(unused) is None


def test_the_second_load_builds_its_tokenizer_without_autotokenizer(tiny, tmp_path,
                                                                    monkeypatch):
    """An embed model's tokenizer, as a chat model's, is of the class AutoTokenizer chose on
    the model's first load (tokenizer.load_hf_tokenizer), with the same vectors."""
    import transformers

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    first = create_engine("torch", tiny["mean"][0], context_length=4096, dtype="float32",
                          task="embed")

    def refused(*args, **kwargs):
        raise AssertionError("AutoTokenizer was asked again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refused)
    second = create_engine("torch", tiny["mean"][0], context_length=4096, dtype="float32",
                           task="embed")
    a, b = embed(first, ["the quick brown fox", LONG]), embed(second, ["the quick brown fox", LONG])
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(np.asarray(a.vectors), np.asarray(b.vectors))
