"""Constrained decoding on both engines, with tiny random models (whose free text is noise):
every completion under a JSON schema parses and validates, greedy or sampled, and a row with a
grammar beside rows without one leaves each with the tokens it gets alone."""

import json

import jsonschema
import numpy as np
import pytest

from engines.base import SamplingParams
from engines.grammar import GrammarError, cut_to_vocab, json_schema_grammar
from tests.engines.helpers import PROMPTS, make_engine, run_batch

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "bc"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
                  "required": ["n"], "additionalProperties": False},
    },
    "required": ["ok", "kind", "inner"],
    "additionalProperties": False,
}


def constrained(**kw):
    return SamplingParams(max_tokens=80, grammar=json_schema_grammar(SCHEMA), **kw)


def text_of(engine, steps):
    return engine.tokenizer.decode([s.token_id for s in steps])


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_completions_under_a_schema_parse_and_validate_inside_a_batch(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    rows = [constrained(temperature=0.0),
            SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
            constrained(temperature=1.0, seed=5)]
    got = run_batch(engine, rows, join_at=[0, 1, 1])
    for i in (0, 2):
        jsonschema.validate(json.loads(text_of(engine, got[i])), SCHEMA)
    # Each row gets what it gets alone: the grammar's matcher is the row's own.
    for i, params in enumerate(rows):
        alone = run_batch(engine, [params], join_at=[0], prompts=[PROMPTS[i]])[0]
        assert [s.token_id for s in got[i]] == [s.token_id for s in alone], i


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_any_json_object_mode_gives_an_object(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            grammar=json_schema_grammar({"type": "object", "maxProperties": 1,
                                                         "additionalProperties": {"type": "null"}}))
    got = run_batch(engine, [params], join_at=[0])[0]
    assert isinstance(json.loads(text_of(engine, got)), dict)


def test_a_schema_llguidance_cannot_follow_names_what_it_lacks():
    with pytest.raises(GrammarError, match="if"):
        json_schema_grammar({"type": "object", "if": {"properties": {}}})


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_forced_tool_call_names_a_tool_with_valid_arguments(tiny_dirs, kind):
    from server.tool_calls import Tool, call_grammar, parse_calls

    tools = (Tool("pick", None, {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                 "required": ["n"], "additionalProperties": False}),
             Tool("flag", None, {"type": "object", "properties": {"on": {"type": "boolean"}},
                                 "required": ["on"], "additionalProperties": False}))
    engine = make_engine(kind, tiny_dirs["llama"][0])
    # One call each: the tiny engines' context (96 tokens, a token a byte) holds one.
    rows = [SamplingParams(max_tokens=70, temperature=t, seed=2,
                           grammar=call_grammar(tools, parallel=False)) for t in (0.0, 1.0)]
    for steps in run_batch(engine, rows, join_at=[0, 0]):
        text = text_of(engine, steps)
        rest, calls = parse_calls(text, {"pick", "flag"})
        assert calls and rest is None, text
        for call in calls:
            schema = next(t.parameters for t in tools if t.name == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


@pytest.mark.parametrize("vocab", [257, 300])
def test_masks_filled_for_a_batch_are_each_grammar_s_own(tiny_dirs, vocab):
    """MaskFiller computes a batch's masks on llguidance's threads: each is what its state
    says alone, bits past the tokenizer's vocabulary clear; a matcher gone wrong allows only
    the end."""
    from engines.grammar import GrammarState, MaskFiller

    tok = make_engine("torch", tiny_dirs["llama"][0]).tokenizer
    grammar = json_schema_grammar(SCHEMA)
    histories = [[], tok.encode('{"ok": '), tok.encode('{"ok": true, "kind": "'),
                 tok.encode("xyz")]
    end = min(tok.eos_token_ids)

    def states():
        return [GrammarState(grammar, tok.grammar_vocabulary(), frozenset({end}))
                for _ in histories]

    alone = [s.bitmask(h, vocab) for s, h in zip(states(), histories)]
    filler, kept = MaskFiller(), states()
    together = filler.bitmasks(list(zip(kept, histories)), vocab)
    assert together.shape == (len(histories), -(-vocab // 8))
    for mine, theirs in zip(together, alone):
        assert np.array_equal(mine, theirs)
    bits = np.unpackbits(together, axis=1, bitorder="little")
    # A step later every row is one token behind (taken in on llguidance's threads): the
    # last allowed token of each mask, or a token the broken row's matcher cannot take.
    later = [h + [int(np.nonzero(b[:vocab])[0][-1])] for h, b in zip(histories, bits)]
    again = filler.bitmasks(list(zip(kept, later)), vocab)
    for mine, fresh, history in zip(again, states(), later):
        assert np.array_equal(mine, fresh.bitmask(history, vocab))
    brace, x = tok.encode("{")[0], tok.encode("x")[0]
    assert bits[0, brace] and not bits[0, x] and bits[0].sum() == 1
    assert bits[2].sum() > 1 and not bits[:, tok.grammar_vocabulary().vocab_size:].any()
    assert bits[3].nonzero()[0].tolist() == [end]  # "xyz" broke the matcher


def test_masks_taken_with_a_token_in_flight_and_computed_on_the_worker(tiny_dirs):
    """take() takes in a row's history and then its token in flight (one the history does not
    hold yet); compute() on the GilFree worker writes the masks into llguidance's layout, each
    as the state alone gives it; the next step's history holds that token, which is not taken
    in twice. A failing job raises where it is waited for."""
    from engines.grammar import GilFree, GrammarState, MaskFiller, mask_words

    tok = make_engine("torch", tiny_dirs["llama"][0]).tokenizer
    grammar, end = json_schema_grammar(SCHEMA), min(tok.eos_token_ids)
    vocabulary = tok.grammar_vocabulary()

    def state():
        return GrammarState(grammar, vocabulary, frozenset({end}))

    text = tok.encode('{"ok": true, "kind": "')
    filler, worker, kept = MaskFiller(), GilFree(), [state(), state()]
    out = np.zeros((2, mask_words(vocabulary.vocab_size)), dtype=np.int32)
    for cut in (3, 5):  # two steps: the second's history holds the first's token in flight
        rows = [(kept[0], text[:cut - 1], text[cut - 1]), (kept[1], text[:cut], None)]
        left = filler.take(rows, out)
        assert [i for _, i in left] == [0, 1]
        worker.start(lambda left=left: filler.compute(left, out)).wait()
        words = out.view(np.uint8)
        for mine in words:
            assert np.array_equal(cut_to_vocab(mine[None], vocabulary.vocab_size, 300)[0],
                                  state().bitmask(text[:cut], 300))

    def fails():
        raise RuntimeError("no mask")

    with pytest.raises(RuntimeError, match="no mask"):
        worker.start(fails).wait()
    worker.close()


def test_the_mask_worker_runs_each_job_once_started_and_starts_again_after_close():
    """GilFree.start() returns once its worker holds the job; wait() gives its end. A closed
    worker's thread ends, and the next start() makes a new one (an executor closed and used
    again)."""
    import threading

    from engines.grammar import GilFree

    worker, ran, inside, release = GilFree(), [], threading.Event(), threading.Event()

    def job():
        ran.append(threading.current_thread().name)
        inside.set()
        release.wait(5)

    started = worker.start(job)
    assert inside.wait(5) and ran == ["grammar-masks"]
    assert not started.done.is_set()  # under way on the worker, not finished
    release.set()
    started.wait()
    first = worker._thread
    worker.close()
    first.join(5)
    assert not first.is_alive()
    worker.start(lambda: ran.append("again")).wait()
    assert ran[-1] == "again" and worker._thread is not first
    worker.close()


def test_prepared_states_mask_as_fresh_ones(tiny_dirs):
    """A state made with its first mask ready (the runtime makes it beside the steps) gives
    the masks a fresh one gives, alone and in a MaskFiller batch, before and after a token."""
    from engines.grammar import GrammarState, MaskFiller

    tok = make_engine("torch", tiny_dirs["llama"][0]).tokenizer
    grammar, end = json_schema_grammar(SCHEMA), min(tok.eos_token_ids)

    def make(ready):
        return (GrammarState.prepared if ready else GrammarState)(
            grammar, tok.grammar_vocabulary(), frozenset({end}))

    fresh = make(False).bitmask([], 300)
    assert np.array_equal(make(True).bitmask([], 300), fresh)
    rows = [(make(True), []), (make(True), [])]
    assert all(np.array_equal(m, fresh) for m in MaskFiller().bitmasks(rows, 300))
    brace = tok.encode("{")
    state = make(True)
    assert np.array_equal(state.bitmask(brace, 300), make(False).bitmask(brace, 300))
    assert not np.array_equal(state.bitmask(brace, 300), fresh)


def test_kept_grammars_give_each_request_a_matcher_of_its_own(tiny_dirs, monkeypatch):
    """A grammar made once serves every request that follows it: each gets a copy at the
    start, whose tokens move it alone (another copy, taken before or after, masks as a fresh
    state does); the ends differ by the request's end tokens; the grammars used last are
    kept, the oldest dropped."""
    from engines.grammar import GrammarState, PreparedGrammars

    tok = make_engine("torch", tiny_dirs["llama"][0]).tokenizer
    grammar, end = json_schema_grammar(SCHEMA), min(tok.eos_token_ids)
    made = []
    prepared = GrammarState.prepared
    monkeypatch.setattr(GrammarState, "prepared",
                        classmethod(lambda cls, *a: made.append(a[0]) or prepared(*a)))
    kept = PreparedGrammars(tok.grammar_vocabulary(), size=2, lineages=1)
    fresh = GrammarState(grammar, tok.grammar_vocabulary(), frozenset({end}))
    brace = tok.encode("{")
    first = kept.state(grammar, frozenset({end}))
    assert np.array_equal(first.bitmask(brace, 300), fresh.bitmask(brace, 300))
    second = kept.state(grammar, frozenset({end}))
    assert np.array_equal(second.bitmask([], 300),
                          GrammarState(grammar, tok.grammar_vocabulary(),
                                       frozenset({end})).bitmask([], 300))
    assert not np.array_equal(second.bitmask([], 300), first.bitmask(brace, 300))
    assert made == [grammar]
    kept.state(grammar, frozenset())  # another end: another grammar
    other = json_schema_grammar({"type": "object", "properties": {"x": {"type": "integer"}}})
    kept.state(other, frozenset({end}))  # the third: the first made is dropped
    kept.state(grammar, frozenset({end}))
    assert made == [grammar, grammar, other, grammar]


def test_a_grammars_requests_take_turns_over_matchers_prepared_apart(tiny_dirs, monkeypatch):
    """With lineages=3 a grammar's first three requests each get a copy of a matcher prepared
    on its own (copies of one share its lexer's caches, whose masks do not run in parallel),
    the next ones copies of those in turn; every one masks as a fresh state does, alone and in
    one MaskFiller call beside the others."""
    from engines.grammar import GrammarState, MaskFiller, PreparedGrammars

    tok = make_engine("torch", tiny_dirs["llama"][0]).tokenizer
    grammar, ends = json_schema_grammar(SCHEMA), frozenset(tok.eos_token_ids)
    made = []
    prepared = GrammarState.prepared
    monkeypatch.setattr(GrammarState, "prepared",
                        classmethod(lambda cls, *a: made.append(prepared(*a)) or made[-1]))
    kept = PreparedGrammars(tok.grammar_vocabulary(), lineages=3)
    copied = []
    copy = GrammarState.copy
    monkeypatch.setattr(GrammarState, "copy",
                        lambda self: copied.append(self) or copy(self))
    states = [kept.state(grammar, ends) for _ in range(7)]
    assert len(made) == 3
    assert copied == [made[i % 3] for i in range(7)]
    assert len({id(s.matcher) for s in states}) == 7  # each request's own matcher
    brace = tok.encode("{")
    fresh = GrammarState(grammar, tok.grammar_vocabulary(), ends).bitmask(brace, 300)
    for state in states[:3]:
        assert np.array_equal(state.bitmask(brace, 300), fresh)
    together = MaskFiller().bitmasks([(s, brace) for s in states[3:]], 300)
    assert all(np.array_equal(row, fresh) for row in together)


def test_a_schema_is_made_into_its_grammar_once(monkeypatch):
    """json_schema_grammar() keeps what it made by the schema's text (keys in their order,
    which is the output's); a schema it cannot follow is refused each time it comes."""
    from llguidance import LLMatcher

    from engines.grammar import GrammarError

    made = []
    make = LLMatcher.grammar_from_json_schema
    monkeypatch.setattr(LLMatcher, "grammar_from_json_schema",
                        lambda *a, **k: made.append(a[0]) or make(*a, **k))
    a = {"type": "object", "properties": {"kept-once": {"type": "integer"}, "b": {}}}
    b = {"type": "object", "properties": {"b": {}, "kept-once": {"type": "integer"}}}
    assert json_schema_grammar(a) == json_schema_grammar(dict(a))
    assert json_schema_grammar(b) != json_schema_grammar(a)
    assert made == [a, b]
    for _ in range(2):
        with pytest.raises(GrammarError):
            json_schema_grammar({"type": "string", "format": "no-such-format-at-all"})
    assert len(made) == 4


def test_a_grammar_is_made_beside_the_steps_and_a_stopped_one_never_joins(tiny_dirs,
                                                                        monkeypatch):
    """Making a request's grammar (its vocabulary view takes over a second for a real model)
    does not hold up the running batch; a request stopped while its grammar is made ends as
    cancelled."""
    import threading

    from engines.base import Cancelled, RequestStats, Step
    from engines.runtime.runtime import Runtime, Submission

    engine = make_engine("torch", tiny_dirs["llama"][0])
    view = engine.tokenizer.grammar_vocabulary()
    release = threading.Event()

    def slow_view():
        release.wait(10)
        return view

    monkeypatch.setattr(engine.tokenizer, "grammar_vocabulary", slow_view)
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=64, threaded_output=False)
    events = {name: [] for name in ("plain", "json", "stopped")}
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runtime.add(Submission(list(PROMPTS[0]), plain, events["plain"].append))
    runtime.add(Submission(list(PROMPTS[1]), constrained(temperature=0.0),
                           events["json"].append))
    runtime.add(Submission(list(PROMPTS[2]), constrained(temperature=0.0),
                           events["stopped"].append, should_stop=lambda: True))
    for _ in range(6):
        runtime.step()
    assert len(events["plain"]) == 6 and not events["json"]  # its grammar is still being made
    assert [type(e) for e in events["stopped"]] == [Cancelled]
    release.set()
    for _ in range(300):
        if not runtime.has_work:
            break
        runtime.step()
    assert not runtime.has_work
    steps = [e for e in events["json"] if isinstance(e, Step) and e.finish_reason is None]
    assert isinstance(events["json"][-1], RequestStats)
    jsonschema.validate(json.loads(text_of(engine, steps)), SCHEMA)
    runtime.close()


def test_the_vocabulary_s_finer_slices_give_llguidance_s_own_masks(tiny_dirs):
    """The engines' vocabulary is built with finer string slices than llguidance's default
    (engines/grammar.vocabulary_slices: cheaper masks for length-bounded strings); slices only
    change how a mask is computed: along a document in and out of bounded and unbounded
    strings (an escaped quote, the bound reached), both give the same masks."""
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    tok = make_engine("torch", tiny_dirs["llama"][0]).tokenizer
    ours = tok.grammar_vocabulary()
    default = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_dirs["llama"][0]),
                                           eos_token=min(tok.eos_token_ids))
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 6}, "b": {"type": "string"},
        "c": {"type": "string", "minLength": 2, "maxLength": 12}},
        "required": ["a", "b", "c"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    ids = tok.encode('{"a": "abcdef", "b": "say \\"hi\\" to all of them", "c": "xy z"}')
    mine, theirs = LLMatcher(ours, grammar), LLMatcher(default, grammar)
    for t in ids:
        assert np.array_equal(mine.compute_bitmask(), theirs.compute_bitmask())
        assert mine.consume_token(t) and theirs.consume_token(t)
    assert mine.is_accepting()
