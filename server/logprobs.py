"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries and the
legacy completions' parallel lists. Each token is named by its own bytes, decoded (a token that
holds part of a character shows U+FFFD there; its `bytes` are exact)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engines.base import Step


@dataclass
class LogprobsFormat:
    chat: bool
    tokenizer: object  # has token_bytes(ids) -> list[bytes]
    offset: int = 0  # the completion text's characters so far (text_offset)

    def of(self, steps: Sequence[Step]) -> dict | None:
        """The logprobs object for these steps (those without log-probabilities skipped: the
        last event, which only ends the generation)."""
        scored = [s for s in steps if s.logprobs is not None]
        if not scored:
            return None
        ids = [s.token_id for s in scored]
        for s in scored:
            ids += [token for token, _ in s.logprobs.top]
        spelled = dict(zip(ids, self.tokenizer.token_bytes(ids)))
        if self.chat:
            return {"content": [self._chat_entry(s, spelled) for s in scored], "refusal": None}
        tokens, offsets = [], []
        for s in scored:
            text = spelled[s.token_id].decode("utf-8", errors="replace")
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [s.logprobs.logprob for s in scored],
            # The k likeliest and the chosen token, as OpenAI's legacy API gives them.
            "top_logprobs": [
                {**{_text(spelled[t]): lp for t, lp in s.logprobs.top},
                 tokens[i]: s.logprobs.logprob}
                for i, s in enumerate(scored)
            ],
            "text_offset": offsets,
        }

    def of_prompt(self, ids: Sequence[int], scores: Sequence) -> dict:
        """The legacy lists for an echoed prompt: its first token unscored (null), as OpenAI
        gives it; the offsets run on into the completion's."""
        spelled = dict(zip(ids, self.tokenizer.token_bytes(list(ids))))
        tops = [t for s in scores if s is not None for t, _ in s.top]
        spelled.update(zip(tops, self.tokenizer.token_bytes(tops)))
        tokens, offsets = [], []
        for token in ids:
            text = _text(spelled[token])
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if s is None else s.logprob for s in scores],
            "top_logprobs": [None if s is None else
                             {**{_text(spelled[t]): lp for t, lp in s.top}, tokens[i]: s.logprob}
                             for i, s in enumerate(scores)],
            "text_offset": offsets,
        }

    @staticmethod
    def _chat_entry(step: Step, spelled: dict[int, bytes]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            raw = spelled[token]
            return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}

        return {**entry(step.token_id, step.logprobs.logprob),
                "top_logprobs": [entry(t, lp) for t, lp in step.logprobs.top]}


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")



def joined(first: dict | None, then: dict | None) -> dict | None:
    """Two pieces of the legacy lists, one after the other."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}
