"""Constrained decoding: a request's grammar (from a JSON schema, through llguidance) becomes a
mask of the tokens that may come next, one row at a time.

llguidance was measured against xgrammar and outlines-core on the default model's vocabulary
(docs/benchmarks.md, "Grammar libraries"). Its grammars are plain strings, so a request's
grammar crosses the engine process's pipe as text; the engine's tokenizer builds llguidance's
view of its vocabulary on the first request that needs it (1.2 s for the default model's 49k
tokens on a 2-core machine: that request's start, and its batch's steps, wait for it once) and
a matcher per request.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger("duet.engines.grammar")


# JSON laid out as json.dumps does, and nowhere else whitespace: with llguidance's flexible
# whitespace a small model may spend its tokens on blanks between two keys (a random-weight one
# did, to max_tokens); these separators are what models see most.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# llguidance's "slices": token sets whose every member a lexer state may allow at once, so a
# mask adds them in bulk instead of walking each token. Its default has string contents of up
# to 10, 30 or any characters; a length-bounded string (maxLength) with fewer than 10 left
# allows none of them whole, and each token was walked. With these finer bounds the masks of
# bench_features' bounded-string schema took 41% less time on average on a 2-core EPYC than
# with the default (scripts/bench_grammar_slices.py; 52 against 88 us, p90 131 against 172),
# the same masks; the vocabulary takes 0.13 s more to build. (4, 8, 10, 16, 24, 30) took 57
# us; every length from 1 to 8 no less at the p90.)
SLICE_LENGTHS = (2, 4, 6, 8, 10, 12, 16, 20, 24, 30)


def vocabulary_slices() -> list[str]:
    """The slices duet's vocabularies are built with (llguidance.hf.from_tokenizer's)."""
    from llguidance import LLTokenizer

    default = LLTokenizer.general_slices()  # blanks, contents {1,10} and {1,30}, contents+
    content = default[-1].removesuffix("+")
    return [default[0], *(f"{content}{{1,{n}}}" for n in SLICE_LENGTHS), default[-1]]


class GrammarError(ValueError):
    """The schema or grammar cannot be used: its message names what is wrong."""


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON text matching `schema` (None: any JSON object). Raises GrammarError
    naming what llguidance does not implement (a keyword, a format)."""
    return _schema_grammar(json.dumps(schema if schema is not None else {"type": "object"}))


# Apps send one schema request after request; made and validated, it took 0.2-0.5 ms of the
# HTTP side's event loop each (64 at once: 35 ms without a chunk sent). A pure function of the
# schema's text (keys in their order: the properties' order is the output's), so kept by it;
# errors are not kept (made again, as they are rare).
@functools.lru_cache(maxsize=256)
def _schema_grammar(schema_text: str) -> str:
    from llguidance import LLMatcher

    return _checked(lambda: LLMatcher.grammar_from_json_schema(
        json.loads(schema_text), defaults=JSON_LAYOUT))


def lark_grammar(lark: str) -> str:
    """llguidance's grammar of a Lark text (which may inline JSON schemas with %json)."""
    from llguidance import LLMatcher

    return _checked(lambda: LLMatcher.grammar_from_lark(lark))


def _checked(make) -> str:
    """make()'s grammar, validated: GrammarError with llguidance's message when it is not."""
    from llguidance import LLMatcher

    try:
        grammar = make()
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(messages[0])
    return grammar


def byte_vocabulary(tokens: Sequence[bytes], eos_token_id: int):
    """llguidance's view of a vocabulary given as each token's bytes (a tokenizer without a
    Hugging Face file: the fake engine's)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    class Spelled:
        bos_token_id = None

        def __init__(self):
            self.eos_token_id = eos_token_id
            self.special_token_ids = [eos_token_id]
            self.tokens = list(tokens)

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return LLTokenizer(TokenizerWrapper(Spelled()))


class GrammarState:
    """One request's place in its grammar. allowed() first takes in the tokens sampled since
    it was last asked (so it follows the sequence however the engine reports them), then says
    which tokens may come next."""

    def __init__(self, grammar: str, vocabulary, eos_token_ids: frozenset[int]):
        """vocabulary: the engine tokenizer's llguidance view (its grammar_vocabulary())."""
        from llguidance import LLMatcher

        self._matcher = LLMatcher(vocabulary, grammar)
        self.vocab_size = vocabulary.vocab_size
        self._eos = sorted(eos_token_ids)
        self._consumed = 0
        self._first: np.ndarray | None = None  # llguidance's mask before any token
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    @classmethod
    def prepared(cls, grammar: str, vocabulary, eos_token_ids: frozenset[int]) -> GrammarState:
        """A state with its first mask already computed: the longest of a request's masks (2 ms
        for a nested schema on a 2-core CPU), so the runtime makes it off the step's thread
        together with the matcher."""
        state = cls(grammar, vocabulary, eos_token_ids)
        state._first = state._raw()
        return state

    def copy(self) -> GrammarState:
        """A state of its own at this one's place (llguidance's deep copy of the matcher, 1 us
        where a new one takes 0.5 ms or more); the first mask is shared, never written."""
        twin = object.__new__(GrammarState)
        twin._matcher = self._matcher.deep_copy()
        twin.vocab_size, twin._eos = self.vocab_size, self._eos
        twin._consumed, twin._first = self._consumed, self._first
        return twin

    def _raw(self) -> np.ndarray:
        return np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)

    def first_mask(self) -> np.ndarray | None:
        """The mask computed before any token (prepared()), while no token has been taken in;
        llguidance's raw bytes."""
        return self._first if self._consumed == 0 else None

    def allowed(self, generated: Sequence[int], vocab: int) -> np.ndarray:
        """A bool mask [vocab] of the tokens that may follow `generated` (every token sampled so
        far): bitmask() unpacked."""
        bits = np.unpackbits(self.bitmask(generated, vocab), bitorder="little")
        return bits[:vocab].astype(bool)

    def bitmask(self, generated: Sequence[int], vocab: int) -> np.ndarray:
        """The tokens that may follow `generated`, packed: uint8 [ceil(vocab / 8)], token t at
        bit t % 8 of byte t // 8. Past the tokenizer's vocabulary (a padded embedding) nothing
        is allowed. A matcher gone wrong (it should not: every token came through its mask)
        allows only the end, so the request ends there and the batch goes on."""
        if not self.advance(generated):
            return self.packed(self.end_only().view(np.uint8), vocab)
        first = self.first_mask()
        return self.packed(first if first is not None else self._raw(), vocab)

    @property
    def matcher(self):
        return self._matcher

    def advance(self, generated: Sequence[int], in_flight: int | None = None) -> bool:
        """Take in the tokens sampled since the last call (then in_flight: a token sampled
        after `generated`, which the sequence's history does not hold yet); False if the
        matcher went wrong."""
        for token in generated[self._consumed:]:
            self._matcher.consume_token(token)
        self._consumed = len(generated)
        if in_flight is not None:
            self._matcher.consume_token(in_flight)
            self._consumed += 1
        return self.healthy()

    def healthy(self) -> bool:
        if self._matcher.is_error():
            log.warning("a grammar ended its request early: %s", self._matcher.get_error())
            return False
        return True

    def end_only(self) -> np.ndarray:
        """The mask that allows only the end, in llguidance's layout: int32
        [mask_words(vocab_size)], token t at bit t % 32 of word t // 32."""
        mask = np.zeros(mask_words(self.vocab_size) * 32, dtype=bool)
        mask[[t for t in self._eos if t < self.vocab_size]] = True
        return np.packbits(mask, bitorder="little").view(np.int32)

    def packed(self, bits: np.ndarray, vocab: int) -> np.ndarray:
        """llguidance's mask bytes for this matcher, cut or padded to vocab (cut_to_vocab)."""
        return cut_to_vocab(bits[None], self.vocab_size, vocab)[0]


def default_lineages() -> int:
    """DUET_GRAMMAR_LINEAGES, else as many as llguidance's executor has threads (80% of the
    CPUs, up to 32)."""
    import os

    asked = os.environ.get("DUET_GRAMMAR_LINEAGES")
    if asked:
        try:
            return max(1, int(asked))
        except ValueError:
            log.warning("DUET_GRAMMAR_LINEAGES=%r is not a whole number: ignored", asked)
    return max(1, min(32, (os.cpu_count() or 1) * 4 // 5))


class PreparedGrammars:
    """Each grammar's prepared state (GrammarState.prepared: its matcher and first mask), made
    once and copied for every request that follows it; the `size` grammars used last are
    kept. For one tokenizer (its vocabulary's).

    A grammar is prepared up to `lineages` times, independently, and its requests copy them in
    turn: llguidance's copies of one matcher share its lexer's caches, and masks of rows
    sharing them do not run in parallel. On an H200's 16-core host, 64 rows of one schema took
    0.86 ms a step for their masks as copies of one matcher and 0.33 over 12 matchers prepared
    apart (a length-bounded string: 4.2 against 1.4 ms); one thread took 0.44 (3.1)
    (scripts/bench_grammar_masks.py, docs/benchmarks.md). A grammar's first `lineages`
    requests each prepare one, on the preparing thread (about 1 ms each for bench_features'
    schemas on a 2-core EPYC: a burst of a new grammar's requests joins a few ms later)."""

    def __init__(self, vocabulary, size: int = 64, lineages: int | None = None):
        self._vocabulary, self._size = vocabulary, size
        self._lineages = lineages or default_lineages()
        # per grammar: its prepared states so far (up to lineages), and which one is next
        self._kept: OrderedDict[tuple[str, frozenset[int]], tuple[list[GrammarState], int]] = \
            OrderedDict()
        self._lock = threading.Lock()

    def state(self, grammar: str, eos_token_ids: frozenset[int]) -> GrammarState:
        key = (grammar, eos_token_ids)
        with self._lock:
            templates, turn = self._kept.pop(key, ([], 0))
            self._kept[key] = (templates, turn + 1)  # the grammar used last goes last
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)
        if len(templates) < self._lineages:
            template = GrammarState.prepared(grammar, self._vocabulary, eos_token_ids)
            with self._lock:
                templates.append(template)
            return template.copy()
        return templates[turn % len(templates)].copy()


def cut_to_vocab(raw: np.ndarray, tokens: int, vocab: int) -> np.ndarray:
    """Masks as llguidance writes them (uint8 [n, m], little-endian 32-bit words) for a
    tokenizer of `tokens` tokens, cut or padded to uint8 [n, ceil(vocab / 8)]: past the
    tokenizer's last token (a padded embedding) nothing is allowed."""
    size = -(-vocab // 8)
    out = np.zeros((raw.shape[0], size), dtype=np.uint8)
    n = min(size, raw.shape[1])
    out[:, :n] = raw[:, :n]
    if tokens < vocab:
        out[:, tokens // 8] &= np.uint8((1 << (tokens % 8)) - 1)
        out[:, tokens // 8 + 1:] = 0
    return out


def mask_words(vocab_size: int) -> int:
    """The int32 words of one of llguidance's masks over a tokenizer of vocab_size tokens."""
    return -(-vocab_size // 32)


class MaskFiller:
    """Many requests' masks in one call, computed on llguidance's own threads (a mask takes
    6-170 us by the grammar's state). The tokens sampled since are taken in first, one row
    after another, on the caller's thread: 1.5 us a token, where llguidance's parallel consume
    cost 7 us a row on a 2-core host and 1.35 ms for 64 rows on a 16-core H100 host (its
    threads' hand-off, not the work).

    take() and compute() split the work for a caller that overlaps the masks with its own:
    take() (holding the GIL) writes the masks known at once; compute() writes the rest without
    the GIL (llguidance releases it), so it can run on a worker (GilFree) while the caller's
    Python goes on."""

    def __init__(self):
        self._executor = None

    def take(self, rows: Sequence[tuple[GrammarState, Sequence[int], int | None]],
             out: np.ndarray) -> list:
        """Each (state, generated, in flight)'s tokens taken in (GrammarState.advance); the
        masks known without llguidance's work (a matcher gone wrong: the end only; the first,
        made when the request came) written to its row of out, int32 [len(rows), words] in
        llguidance's layout (mask_words() of the states' tokenizer, the same for all). Returns
        what compute() needs for the other rows."""
        words = out.shape[1]
        todo = []
        for i, (state, generated, in_flight) in enumerate(rows):
            if mask_words(state.vocab_size) != words:
                raise ValueError("a batch's grammars must share one tokenizer")
            if not state.advance(generated, in_flight):
                out[i] = state.end_only()
            elif (first := state.first_mask()) is not None:
                out[i] = first.view(np.int32)[:words]
            else:
                todo.append((state.matcher, i))
        return todo

    def compute(self, todo: list, out: np.ndarray) -> None:
        """The masks take() left to llguidance, written into their rows of out (which must stay
        alive, and untouched, until this returns). Runs without the GIL."""
        from llguidance import LLExecutor

        if not todo:
            return
        if self._executor is None:
            self._executor = LLExecutor()
        self._executor.unsafe_compute_mask_ptr(todo, out.ctypes.data, out.shape[1] * 4,
                                               out.shape[0])

    def bitmasks(self, rows: Sequence[tuple[GrammarState, Sequence[int]]],
                 vocab: int) -> np.ndarray:
        """uint8 [len(rows), ceil(vocab / 8)]: each (state, generated)'s bitmask()."""
        if not rows:
            return np.zeros((0, -(-vocab // 8)), dtype=np.uint8)
        tokens = rows[0][0].vocab_size
        out = np.zeros((len(rows), mask_words(tokens)), dtype=np.int32)
        self.compute(self.take([(state, generated, None) for state, generated in rows], out),
                     out)
        return cut_to_vocab(out.view(np.uint8), tokens, vocab)


class GilFree:
    """One worker thread for calls that release the GIL (llguidance's masks): start() hands
    one over and returns once the worker holds it, so the call is under way while the caller
    goes on (a thread that has to ask for the GIL may wait the interpreter's whole switch
    interval, 5 ms, behind a busy caller); wait() gives its result."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None

    def start(self, fn) -> Job:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grammar-masks", daemon=True)
            self._thread.start()
        job = Job(fn)
        self._jobs.put(job)
        job.started.wait()
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.started.set()
            try:
                job.fn()
            except Exception as exc:  # raised where the caller waits
                job.error = exc
            job.done.set()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class Job:
    """A call handed to GilFree: wait() for it."""

    def __init__(self, fn):
        self.fn, self.error = fn, None
        self.started, self.done = threading.Event(), threading.Event()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error
