"""The chat tokenizer built beside a load: on a thread of its own, the same tokenizer, its
errors raised where it is waited for."""

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


def test_an_engine_process_imports_the_compiler_and_the_tokenizer_library_before_its_load():
    """The torch backend's imports (factory.import_backend, run in an engine's process while
    the server decides) leave its load only the model's own: a fresh interpreter has torch's
    compiler and transformers' tokenizer classes after it."""
    import subprocess
    import sys

    probe = ("import sys; from engines.factory import import_backend; import_backend('torch'); "
             "print(all(m in sys.modules for m in ('torch._dynamo', 'torch.distributed.tensor', "
             "'transformers.models.auto.tokenization_auto')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "True"
