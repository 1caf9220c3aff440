"""End-of-sequence ids come from the tokenizer, config.json and generation_config.json (Llama 3
lists several there), and a generation on either engine stops at any of them."""

import json
import shutil

import pytest

from engines.base import RequestStats, SamplingParams, Step
from engines.tokenizer import ChatTokenizer

PROMPT = [5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def engines(path):
    from engines.torch_engine import TorchEngine

    yield TorchEngine(path, context_length=64, dtype="float32", device="cpu")
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    yield MLXEngine(path, context_length=64, dtype="float32")


def generate(engine, params=GREEDY):
    events = list(engine.generate(PROMPT, params))
    ids = [e.token_id for e in events if isinstance(e, Step) and e.finish_reason is None]
    return ids, events[-1]


def with_eos(tmp_path, tiny_dirs, *, config=None, generation_config=None):
    path = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"][0], path)
    for name, eos in (("config.json", config), ("generation_config.json", generation_config)):
        if eos is not None:
            data = json.loads((path / name).read_text())
            data["eos_token_id"] = eos
            (path / name).write_text(json.dumps(data))
    return path


def test_every_listed_end_of_sequence_id_is_read(tmp_path, tiny_dirs):
    path = with_eos(tmp_path, tiny_dirs, config=[40], generation_config=[41, 42])
    # The tokenizer's own end token (<|im_end|> = 2) and every id both files list.
    assert ChatTokenizer(path).eos_token_ids == {2, 40, 41, 42}
    path = with_eos(tmp_path / "single", tiny_dirs, config=2, generation_config=77)
    assert ChatTokenizer(path).eos_token_ids == {2, 77}


@pytest.mark.parametrize("where", ["generation_config", "config"])
def test_generation_stops_at_an_end_id_from_the_model_files(tmp_path, tiny_dirs, where):
    plain = list(engines(tiny_dirs["llama"][0]))
    free = {e.name: generate(e, SamplingParams(max_tokens=12, temperature=0.0,
                                                 ignore_eos=True))[0] for e in plain}
    # The model's fourth greedy token becomes an end of sequence (unless it is one already).
    ids = free["torch"]
    assert len(ids) == 12 and ids[3] not in ids[:3] and ids[3] != 2
    path = with_eos(tmp_path, tiny_dirs, **{where: [2, ids[3]]})
    for engine in engines(path):
        assert free[engine.name] == ids, engine.name  # the engines agree before the change
        got, stats = generate(engine)
        assert isinstance(stats, RequestStats)
        assert got == ids[:3] and stats.finish_reason == "stop", engine.name
        assert stats.completion_tokens == 4  # the end token counts, as OpenAI's usage does


def test_the_chat_template_ends_with_the_assistant_turn(tiny_dirs):
    tok = ChatTokenizer(tiny_dirs["llama"][0])
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages)
    opening = [1] + tok.encode("assistant\n")  # <|im_start|>assistant, the model's turn
    assert ids[-len(opening):] == opening and "hi" in tok.decode(ids)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == ids[: -len(opening)]
