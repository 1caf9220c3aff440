"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries and the
legacy completions' parallel lists. Each token is named by its own bytes, decoded (a token that
holds part of a character shows U+FFFD there; its `bytes` are exact)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engines.base import Step, TokenLogprobs


@dataclass
class LogprobsFormat:
    chat: bool
    tokenizer: object  # has token_names(ids) -> [(text, bytes as ints)], kept for every request
    offset: int = 0  # the completion text's characters so far (text_offset)

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

    def _names(self, ids: Sequence[int], scores: Sequence[TokenLogprobs | None]) -> list:
        """The names (text, bytes) of each token followed by its alternatives', in one call."""
        flat = []
        for token, scored in zip(ids, scores):
            flat.append(token)
            if scored is not None:
                flat.extend(t for t, _ in scored.top)
        return self.tokenizer.token_names(flat)

    def _legacy(self, ids: Sequence[int], scores: Sequence[TokenLogprobs | None]) -> dict:
        """Completions' parallel lists; top_logprobs holds the k likeliest and the chosen
        token, as OpenAI's legacy API gives them."""
        names = iter(self._names(ids, scores))
        tokens, offsets, tops = [], [], []
        for scored in scores:
            text = next(names)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if scored is None:
                tops.append(None)
                continue
            top = {next(names)[0]: _finite(lp) for _, lp in scored.top}
            top[text] = _finite(scored.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [None if s is None else _finite(s.logprob) for s in scores],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entries(self, ids: list[int], scores: list[TokenLogprobs]) -> list[dict]:
        names = iter(self._names(ids, scores))
        out = []
        # The floor inline, not _finite(): six calls a token at 25,000 tokens a second.
        for scored in scores:
            text, raw = next(names)
            top = []
            for _, lp in scored.top:
                name = next(names)
                top.append({"token": name[0], "logprob": lp if lp > FLOOR else FLOOR,
                            "bytes": name[1]})
            lp = scored.logprob
            out.append({"token": text, "logprob": lp if lp > FLOOR else FLOOR, "bytes": raw,
                        "top_logprobs": top})
        return out


# What a token that cannot come (masked by a grammar, banned by a bias of -100) is given
# instead of -inf, which JSON cannot carry and OpenAI's clients would not parse (vLLM and
# OpenAI give -9999.0 too).
FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(FLOOR, logprob)


def joined(first: dict | None, then: dict | None) -> dict | None:
    """Two pieces of the legacy lists, one after the other."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}
