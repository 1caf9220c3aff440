"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries and the
legacy completions' parallel lists. Each token is named by its own bytes, decoded (a token that
holds part of a character shows U+FFFD there; its `bytes` are exact)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.base import Step, TokenLogprobs


@dataclass
class LogprobsFormat:
    chat: bool
    tokenizer: object  # has token_bytes(ids) -> list[bytes]
    offset: int = 0  # the completion text's characters so far (text_offset)
    # token -> (its text, its bytes) for the tokens this request has named so far: a stream's
    # alternatives repeat, and at 64 streams the server names some 200,000 tokens a second.
    _names: dict[int, tuple[str, list[int]]] = field(default_factory=dict, repr=False)

    def of(self, steps: Sequence[Step]) -> dict | None:
        """The logprobs object for these steps (those without log-probabilities skipped: the
        last event, which only ends the generation)."""
        scored = [s for s in steps if s.logprobs is not None]
        if not scored:
            return None
        ids, scores = [s.token_id for s in scored], [s.logprobs for s in scored]
        if self.chat:
            return {"content": self._chat_entries(ids, scores), "refusal": None}
        return self._legacy(ids, scores)

    def of_prompt(self, ids: Sequence[int], scores: Sequence[TokenLogprobs | None]) -> dict:
        """The legacy lists for an echoed prompt: its first token unscored (null), as OpenAI
        gives it; the offsets run on into the completion's."""
        return self._legacy(ids, scores)

    def _named(self, ids: Sequence[int], scores: Sequence[TokenLogprobs | None]) -> dict:
        """token -> (its text, its bytes), for these tokens and their alternatives: those not
        named before spelled by the tokenizer in one call."""
        names = self._names
        new = {t for t in ids if t not in names}
        new.update(t for s in scores if s is not None for t, _ in s.top if t not in names)
        if new:
            new = list(new)
            for token, raw in zip(new, self.tokenizer.token_bytes(new)):
                names[token] = (_text(raw), list(raw))
        return names

    def _legacy(self, ids: Sequence[int], scores: Sequence[TokenLogprobs | None]) -> dict:
        """Completions' parallel lists; top_logprobs holds the k likeliest and the chosen
        token, as OpenAI's legacy API gives them."""
        names = self._named(ids, scores)
        tokens, offsets = [], []
        for token in ids:
            text = names[token][0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if s is None else _finite(s.logprob) for s in scores],
            "top_logprobs": [None if s is None else
                             {**{names[t][0]: _finite(lp) for t, lp in s.top},
                              tokens[i]: _finite(s.logprob)}
                             for i, s in enumerate(scores)],
            "text_offset": offsets,
        }

    def _chat_entries(self, ids: list[int], scores: list[TokenLogprobs]) -> list[dict]:
        names = self._named(ids, scores)
        out = []
        for token, scored in zip(ids, scores):
            text, raw = names[token]
            out.append({"token": text, "logprob": _finite(scored.logprob), "bytes": raw,
                        "top_logprobs": [
                            {"token": names[t][0], "logprob": _finite(lp), "bytes": names[t][1]}
                            for t, lp in scored.top]})
        return out


# What a token that cannot come (masked by a grammar, banned by a bias of -100) is given
# instead of -inf, which JSON cannot carry and OpenAI's clients would not parse (vLLM and
# OpenAI give -9999.0 too).
FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(FLOOR, logprob)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def joined(first: dict | None, then: dict | None) -> dict | None:
    """Two pieces of the legacy lists, one after the other."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}
