"""How a request's logits are reshaped from its own history before the draw: the repetition
penalty first, then logit_bias and the presence and frequency penalties, added together. The
same rule on both engines (each applies it with its own arrays: torch_engine/sampling.py,
mlx_engine/sampling.py). Log-probabilities are reported after it.

- logit_bias (OpenAI): a token's logit plus its bias (-100 to 100; -100 all but bans it).
- repetition_penalty (transformers' and vLLM's): every token of the prompt or the completion so
  far has its logit divided by the penalty when positive, multiplied when negative (> 1 makes
  repeats less likely).
- presence_penalty / frequency_penalty (OpenAI): a token already in the completion (not the
  prompt) loses presence_penalty once, and frequency_penalty for each time it occurs.
- a grammar (response_format, tool calls) comes last: every token it does not allow next is
  masked out, whatever the bias said.

min_p is a filter of the draw, not a processing step: after temperature, tokens less likely
than min_p times the likeliest are dropped (before top_k and top_p).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .base import SamplingParams
from .grammar import GrammarState


@dataclass(frozen=True)
class Processing:
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: GrammarState | None = None  # the request's own: it follows the sequence

    @classmethod
    def of(cls, params: SamplingParams, grammar: GrammarState | None = None) -> Processing | None:
        """None when every setting is neutral: the row keeps the fast paths."""
        made = cls(params.logit_bias, params.repetition_penalty, params.presence_penalty,
                   params.frequency_penalty, grammar)
        return None if made == cls() else made

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def needs_history(self) -> bool:
        """Whether the row's tokens so far change its processing (a bias alone does not)."""
        return self.penalised or self.grammar is not None

    def waits_for_tokens(self, processes_in_flight: bool) -> bool:
        """Whether the row's next step must wait for its last token to reach the host's
        history (unless the executor processes rows with a token in flight)."""
        return self.needs_history and not processes_in_flight

    def additions(self, generated: Sequence[int]) -> dict[int, float]:
        """token -> what is added to its logit: the bias and the completion's penalties."""
        out: dict[int, float] = {}
        for token, bias in self.logit_bias:
            out[token] = out.get(token, 0.0) + bias
        if self.presence_penalty or self.frequency_penalty:
            for token, count in Counter(generated).items():
                out[token] = (out.get(token, 0.0) - self.presence_penalty
                              - self.frequency_penalty * count)
        return out

    def repeated(self, prompt: Sequence[int], generated: Sequence[int]) -> list[int]:
        """The tokens the repetition penalty applies to (none when it is neutral)."""
        if self.repetition_penalty == 1.0:
            return []
        return sorted(set(prompt).union(generated))
