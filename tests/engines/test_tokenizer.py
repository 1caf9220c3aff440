"""The chat tokenizer built beside a load: on a thread of its own, the same tokenizer, its
errors raised where it is waited for; the class AutoTokenizer chose for a model kept for its
next start."""

import os
import threading

import pytest

from engines import tokenizer as tokenizer_module
from engines.tokenizer import ChatTokenizer, build_beside


def test_the_tokenizer_is_built_on_another_thread_and_is_the_same(tiny_dirs, monkeypatch):
    path = tiny_dirs["llama"][0]
    threads = []
    real_init = ChatTokenizer.__init__

    def init(self, model_dir):
        threads.append(threading.current_thread())
        real_init(self, model_dir)

    monkeypatch.setattr(tokenizer_module.ChatTokenizer, "__init__", init)
    built = build_beside(path)()
    assert threads and threads[0] is not threading.current_thread()
    alone = ChatTokenizer(path)
    text = "Hello there, ünïcödé 🙂"
    assert built.encode(text) == alone.encode(text)
    assert built.eos_token_ids == alone.eos_token_ids and built.vocab_size == alone.vocab_size


def test_a_tokenizer_that_cannot_be_built_fails_where_it_is_waited_for(tmp_path):
    wait = build_beside(tmp_path / "missing")  # no error yet: the caller's load goes on
    with pytest.raises(OSError):  # transformers' own error for a directory without files
        wait()


def test_an_engine_process_imports_the_compiler_before_its_load_and_no_tokenizer_code():
    """The torch backend's imports (factory.import_backend, run in an engine's process while
    the server decides) leave its load only the model's own and the tokenizer's, which the
    load builds beside its weights: a fresh interpreter has torch's compiler after them, and
    none of AutoTokenizer's (transformers' model and generation code: seconds)."""
    import subprocess
    import sys

    probe = ("import sys; from engines.factory import import_backend; import_backend('torch'); "
             "print([m in sys.modules for m in ('torch._dynamo', 'torch.distributed.tensor', "
             "'transformers.models.auto.tokenization_auto', 'transformers.generation')])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[True, True, False, False]"


def test_autotokenizers_choice_is_kept_and_built_directly_the_next_time(tiny_dirs, tmp_path,
                                                                         monkeypatch):
    """A model's second start builds the tokenizer class AutoTokenizer chose on its first, in
    a fresh interpreter without AutoTokenizer's imports, and it is the same tokenizer."""
    import json
    import subprocess
    import sys

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    path = tiny_dirs["llama"][0]
    first = ChatTokenizer(path)
    records = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(records) == 1
    module, name = json.loads(records[0].read_text())
    assert (module, name) == (type(first._tok).__module__, type(first._tok).__name__)
    text = "Hello there, ünïcödé 🙂"
    messages = [{"role": "user", "content": text}]
    probe = (
        "import json, sys; from engines.tokenizer import ChatTokenizer; "
        f"t = ChatTokenizer({str(path)!r}); "
        f"print(json.dumps([type(t._tok).__name__, t.encode({text!r}), t.encode_prompt({text!r}), "
        f"t.apply_chat_template({messages!r}), t.vocab_size, sorted(t.eos_token_ids), "
        "'transformers.models.auto.tokenization_auto' in sys.modules, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True, env={**os.environ})
    assert json.loads(done.stdout) == [
        name, first.encode(text), first.encode_prompt(text), first.apply_chat_template(messages),
        first.vocab_size, sorted(first.eos_token_ids), False, False]


def test_a_kept_choice_that_no_longer_loads_is_made_again(tiny_dirs, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    path = tiny_dirs["llama"][0]
    usual = ChatTokenizer(path)
    (record,) = (tmp_path / "tokenizers").glob("*.json")
    record.write_text(json.dumps(["transformers", "NoSuchTokenizer"]))  # another install's
    again = ChatTokenizer(path)
    assert type(again._tok) is type(usual._tok)
    assert again.encode("abc déf") == usual.encode("abc déf")
    assert json.loads(record.read_text())[1] == type(usual._tok).__name__  # chosen anew
