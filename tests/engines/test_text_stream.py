"""Incremental detokenization and stop strings, on a real byte-level BPE tokenizer."""

import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engines.base import RequestStats, SamplingParams, Step
from engines.fake import EOS, ByteTokenizer
from engines.runtime.output import RequestOutput
from engines.tokenizer import ChatTokenizer, IncrementalDetokenizer, StopMatcher

TEXTS = ["Hello 世界 🙂 naïve café", "🇫🇷 drapeau et 東京タワー", "plain ascii only", "é" * 9]


@pytest.fixture(scope="module")
def byte_bpe(tiny_dirs):
    return ChatTokenizer(tiny_dirs["llama"][0])


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_split_a_character(byte_bpe, text):
    ids = byte_bpe.encode(text)
    assert len(ids) > len(text) or text.isascii()  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(byte_bpe)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@given(st.text(min_size=0, max_size=40))
@settings(max_examples=150, deadline=None)
def test_detokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in tok.encode(text)] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@given(
    text=st.text(alphabet="abcXY🙂 ", min_size=0, max_size=40),
    stops=st.lists(st.text(alphabet="abcXY🙂", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
@example(text="XXaX", stops=["a", "XaX"], cuts=[3])  # a later-starting stop completes first
@example(text="xxabcd", stops=["abcd"], cuts=[4])  # held: a partial of every length
@example(text="xxabcd", stops=["abcd"], cuts=[3, 5])
@settings(max_examples=300, deadline=None)
def test_stop_matcher_emits_exactly_the_text_before_the_first_stop(text, stops, cuts):
    pieces, last = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces.append(text[last:c])
        last = c
    matcher = StopMatcher(stops)
    out = ""
    for piece in pieces:
        out += matcher.feed(piece)
        if matcher.stopped:
            break
    if not matcher.stopped:
        out += matcher.flush()
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert out == (text[: min(hits)] if hits else text)
    assert matcher.stopped == bool(hits)


def test_text_no_stop_could_complete_is_released_at_once():
    """Only a tail that may still become a stop is held back; the rest streams now."""
    matcher = StopMatcher(["xyz", "hello!"])
    assert matcher.feed("hello") == ""  # may be the start of "hello!"
    assert matcher.feed(" world") == "hello world"
    assert matcher.feed(" x") == " "  # "x" may start "xyz"
    assert matcher.feed("y") == ""
    assert matcher.feed("w") == "xyw"
    assert StopMatcher(["abcd"]).feed("xxab") == "xx"


def _run(reply_ids, params):
    out = RequestOutput(ByteTokenizer(), params, prompt_tokens=3, engine="t", device="cpu",
                        arrival=time.perf_counter())
    out.kv_cache_bytes = 7
    events = []
    for token in reply_ids:
        events += out.add(token)
        if out.done:
            break
    events += out.close()
    steps = [e for e in events if isinstance(e, Step)]
    assert isinstance(events[-1], RequestStats)
    assert all(s.finish_reason is None for s in steps[:-1]) and steps[-1].finish_reason
    return "".join(s.text for s in steps), events[-1]


def test_stream_stops_at_eos_and_counts_it():
    ids = ByteTokenizer().encode("hi 🙂") + [EOS, 65, 66]
    text, stats = _run(ids, SamplingParams(max_tokens=50))
    assert text == "hi 🙂" and stats.finish_reason == "stop"
    assert stats.completion_tokens == len("hi 🙂".encode()) + 1
    assert stats.kv_cache_bytes == 7 and stats.prompt_tokens == 3


def test_stream_stops_at_max_tokens():
    text, stats = _run(ByteTokenizer().encode("abcdefgh"), SamplingParams(max_tokens=5))
    assert text == "abcde" and stats.finish_reason == "length" and stats.completion_tokens == 5


def test_stop_string_split_across_tokens_is_never_emitted():
    ids = ByteTokenizer().encode("Paris.\nUser: more")
    text, stats = _run(ids, SamplingParams(max_tokens=50, stop=("\nUser:",)))
    assert text == "Paris." and stats.finish_reason == "stop"


def test_max_tokens_inside_a_partial_stop_releases_held_text():
    ids = ByteTokenizer().encode("abc\nUs")
    text, stats = _run(ids, SamplingParams(max_tokens=6, stop=("\nUser:",)))
    assert text == "abc\nUs" and stats.finish_reason == "length"


def test_a_stop_found_only_when_the_text_ends_still_says_stop():
    # "y" is a stop, but "xyz1" began before it and might still complete, so "xy" is held back
    # until the generation ends (max_tokens): then "y" wins, and the reason is stop, not length.
    ids = ByteTokenizer().encode("xy")
    text, stats = _run(ids, SamplingParams(max_tokens=2, stop=("xyz1", "y")))
    assert text == "x" and stats.finish_reason == "stop"


def test_a_character_cut_off_by_max_tokens_still_sends_its_bytes():
    # The detokenizer holds an incomplete character back; the end releases it (as U+FFFD).
    ids = ByteTokenizer().encode("a🙂")[:3]
    text, stats = _run(ids, SamplingParams(max_tokens=3))
    assert text == "a" + ByteTokenizer().decode(ids[1:]) != "a"
    assert stats.finish_reason == "length"


def test_ignore_eos_keeps_going():
    ids = [65, EOS, 66]
    text, stats = _run(ids, SamplingParams(max_tokens=3, ignore_eos=True))
    assert stats.completion_tokens == 3 and stats.finish_reason == "length"


@pytest.mark.parametrize("text", TEXTS)
def test_the_rust_stream_gives_the_windowed_deltas(byte_bpe, text):
    """The fast path (tokenizers' DecodeStream) releases the same text at the same tokens as
    the windowed decodes it replaces."""
    ids = byte_bpe.encode(text)
    fast = IncrementalDetokenizer(byte_bpe)
    assert fast._stream is not None
    slow = IncrementalDetokenizer(byte_bpe)
    slow._stream = None
    assert [fast.add(i) for i in ids] == [slow.add(i) for i in ids]
    assert fast.flush() == slow.flush()



def test_request_stats_are_computed_from_the_request_own_times():
    """Arrival 10.0, first scheduled 10.25, tokens at 10.5 and 10.75, closed at 11.0."""
    times = iter([10.5, 10.75, 11.0])
    out = RequestOutput(ByteTokenizer(), SamplingParams(max_tokens=2), prompt_tokens=3,
                        engine="torch", device="cuda", arrival=10.0, clock=lambda: next(times))
    out.scheduled_at = 10.25
    out.peak_memory_bytes, out.kv_cache_bytes = 123, 456
    events = out.add(65) + out.add(66)
    assert out.done and [e.text for e in events] == ["A", "B"]
    last, stats = out.close()
    assert (last.token_id, last.text, last.finish_reason) == (66, "", "length")
    assert stats == RequestStats(
        prompt_tokens=3, completion_tokens=2, ttft_s=0.5, prefill_tokens_per_s=12.0,
        decode_tokens_per_s=4.0, peak_memory_bytes=123, kv_cache_bytes=456, engine="torch",
        device="cuda", finish_reason="length", total_s=1.0, queue_s=0.25)


def test_a_request_cancelled_before_its_first_token_reports_no_speeds():
    times = iter([10.5])
    out = RequestOutput(ByteTokenizer(), SamplingParams(max_tokens=5), prompt_tokens=3,
                        engine="mlx", device="cpu", arrival=10.0, clock=lambda: next(times))
    last, stats = out.close("cancelled")
    assert last.finish_reason == stats.finish_reason == "cancelled" and last.text == ""
    assert (stats.completion_tokens, stats.ttft_s, stats.total_s, stats.queue_s) == (0, 0.5, 0.5, 0.5)
    assert stats.prefill_tokens_per_s == stats.decode_tokens_per_s == 0.0


def test_tokens_sampled_at_the_same_instant_report_no_decode_speed_instead_of_failing():
    """Two tokens stamped with one time (a coarse clock): no decode time, so no speed, and no
    division by zero. The times given to add() are the step's, not the clock's."""
    out = RequestOutput(ByteTokenizer(), SamplingParams(max_tokens=2), prompt_tokens=3,
                        engine="torch", device="cpu", arrival=10.0, clock=lambda: 12.0)
    out.add(65, 11.0) + out.add(66, 11.0)
    _, stats = out.close()
    assert stats.decode_tokens_per_s == 0.0 and stats.ttft_s == 1.0 and stats.total_s == 2.0
    assert out.finish == "length" and out.closed


# -- the tokenizer's own contract (what mutation testing found unguarded) -------------------


@pytest.fixture(scope="module")
def bos_bpe(tiny_dirs, tmp_path_factory):
    """The tiny tokenizer with a post-processor that puts BOS first, as Llama's does."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["llama"][0]))
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    out = tmp_path_factory.mktemp("bos-tokenizer")
    tok.save_pretrained(out)
    return ChatTokenizer(out)


def test_a_completion_prompt_starts_with_bos_and_generated_text_does_not(bos_bpe):
    bos = bos_bpe.bos_token_id
    assert bos == bos_bpe._tok.convert_tokens_to_ids("<|im_start|>")
    body = bos_bpe.encode("hi there")
    assert bos not in body and body
    assert bos_bpe.encode_prompt("hi there") == [bos, *body]
    # decode() drops special tokens: the prompt's BOS, an end token
    assert bos_bpe.decode(bos_bpe.encode_prompt("hi there")) == "hi there"
    assert bos_bpe.decode([*body, *bos_bpe.eos_token_ids]) == "hi there"


def test_the_chat_template_gives_transformers_token_ids(byte_bpe):
    messages = [{"role": "user", "content": "hello 🙂"}]
    ids = byte_bpe.apply_chat_template(messages)
    assert ids == list(byte_bpe._tok.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
    assert all(type(t) is int for t in ids)
    assert byte_bpe.decode(ids) == "user\nhello 🙂\nassistant\n"


@pytest.mark.parametrize("shape", ["dict", "encoding"])
def test_a_chat_template_answered_as_a_dict_still_gives_ids(byte_bpe, monkeypatch, shape):
    """Some transformers versions answer apply_chat_template with a dict or a BatchEncoding
    whatever return_dict says."""
    from transformers import BatchEncoding

    answer = {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}
    if shape == "encoding":
        answer = BatchEncoding(answer)
    monkeypatch.setattr(byte_bpe._tok, "apply_chat_template", lambda *a, **k: answer)
    assert byte_bpe.apply_chat_template([{"role": "user", "content": "x"}]) == [5, 6, 7]


def test_a_model_without_a_chat_template_says_to_use_completions(tiny_dirs, monkeypatch):
    tok = ChatTokenizer(tiny_dirs["llama"][0])
    assert tok.has_chat_template
    tok.has_chat_template = False
    with pytest.raises(ValueError, match=r"no chat template; use /v1/completions"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_the_rust_stream_skips_special_tokens_and_stands_aside_for_space_clean_up(tiny_dirs):
    tok = ChatTokenizer(tiny_dirs["llama"][0])
    detok = IncrementalDetokenizer(tok)
    assert detok._stream is not None
    eos = next(iter(tok.eos_token_ids))
    assert [detok.add(t) for t in [*tok.encode("ab"), eos]] in (["a", "b", ""], ["", "ab", ""])
    # transformers' clean-up would change decode()'s text: the windowed decodes apply it
    tok._tok.clean_up_tokenization_spaces = True
    assert tok.decode_stream() is None
    tok._tok.clean_up_tokenization_spaces = False
    assert tok.decode_stream() is not None


def test_a_character_cut_off_at_the_end_is_flushed_from_the_rust_stream(byte_bpe):
    ids = byte_bpe.encode("a🙂")
    detok = IncrementalDetokenizer(byte_bpe)
    assert detok._stream is not None
    assert "".join(detok.add(i) for i in ids[:-1]) == "a"  # the emoji's last byte never came
    assert detok.flush() == "\ufffd"  # its bytes so far, not nothing


def test_the_tokenizer_crosses_a_process_boundary_with_a_lock_of_its_own(byte_bpe):
    import pickle

    assert "_lock" not in byte_bpe.__getstate__()
    copy = pickle.loads(pickle.dumps(byte_bpe))
    assert copy._lock is not byte_bpe._lock and copy._lock.acquire(blocking=False)
    copy._lock.release()
    assert copy.encode("héllo") == byte_bpe.encode("héllo")
    assert copy.eos_token_ids == byte_bpe.eos_token_ids


def test_a_complete_stop_wins_over_a_longer_one_starting_at_the_same_place():
    matcher = StopMatcher(["ab", "abc"])
    assert matcher.feed("xab") == "x" and matcher.stopped


def test_token_names_spell_each_token_once(tiny_dirs, monkeypatch):
    """Logprobs' names: each token's own bytes (decoded, U+FFFD for part of a character), the
    same in any list; a list with tokens named before spells only the new ones."""
    tok = ChatTokenizer(tiny_dirs["llama"][0])
    ids = tok.encode("Hello 世界 naïve")
    spelled = []
    spell = tok._spell
    monkeypatch.setattr(tok, "_spell", lambda some: spelled.append(list(some)) or spell(some))
    first = tok.token_names(ids[:3])
    names = tok.token_names(ids + ids[:2])
    assert names[:3] == first and names[-2:] == names[:2]
    assert spelled == [ids[:3], [i for i in dict.fromkeys(ids) if i not in ids[:3]]]
    assert b"".join(bytes(raw) for _, raw in names[: len(ids)]).decode() == "Hello 世界 naïve"
    assert all(text == bytes(raw).decode("utf-8", errors="replace") for text, raw in names)
