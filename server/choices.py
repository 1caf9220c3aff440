"""One response's choices: a choice per prompt and per `n`, each its own generation in the
engine's batch, turned into OpenAI choice objects and SSE chunks (indexed prompt-major:
choice i*n + j is prompt i's j-th), and merged into one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engines.base import RequestStats, Step

from .logprobs import LogprobsFormat, joined
from .streaming import ResponseShape, sse
from .tool_calls import CallHolder, ToolUse, parse_calls


@dataclass
class Choice:
    """A choice's events and what shapes them: its log-probabilities' format (which counts the
    text's offsets) and, with tools, the hold-back of a call's text."""

    index: int
    events: AsyncIterator
    scores: LogprobsFormat | None = None
    tools: ToolUse | None = None
    # completions' echo: the prompt's text and ids, which come first in the choice's text (and,
    # with logprobs, its scores first in its logprobs)
    echo: tuple[str, list[int]] | None = None
    holder: CallHolder | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.holder = CallHolder()

    def whole(self, shape: ResponseShape, steps: list[Step], stats: RequestStats) -> dict:
        """The choice object of a response that is not streamed."""
        text: str | None = "".join(step.text for step in steps)
        calls = None
        if self.tools is not None:
            text, calls = parse_calls(text, {t.name for t in self.tools.tools})
            if text is None and not calls:
                text = ""
        echoed = self._echo(steps)
        logprobs = self.scores.of(steps) if self.scores else None
        if echoed is not None:
            text = echoed[0] + text
            logprobs = joined(echoed[1], logprobs)
        return shape.choice(self.index, text, stats, logprobs, calls)

    def _echo(self, steps: list[Step]) -> tuple[str, dict | None] | None:
        """The echoed prompt's text and logprobs, once: from the choice's first Step (which
        carries the prompt's scores when they were asked for)."""
        if self.echo is None or not steps:
            return None
        (text, ids), self.echo = self.echo, None
        scores = steps[0].prompt_logprobs
        if self.scores is None or scores is None:
            return text, None
        return text, self.scores.of_prompt(ids, scores)

    def advance(self, batch: list) -> Progress:
        """What a batch of this choice's events adds; with its last batch (the stats), the
        held-back text parsed into calls and the text around them."""
        steps = [e for e in batch if isinstance(e, Step)]
        echoed = self._echo(steps)
        text = "".join(e.text for e in steps)
        if self.holder is not None:  # a call's text is held until it is whole
            text = self.holder.feed(text)
        if echoed is not None:
            text = echoed[0] + text
        logprobs = None
        if self.scores is not None:  # every token's scores, its text shown or held back
            logprobs = joined(echoed[1] if echoed else None, self.scores.of(steps))
        progress = Progress(text, logprobs)
        if batch and isinstance(batch[-1], RequestStats):
            progress.stats = batch[-1]
            if self.holder is not None:
                progress.rest, progress.calls = parse_calls(self.holder.held,
                                                            {t.name for t in self.tools.tools})
        return progress

    def chunks(self, shape: ResponseShape, batch: list, include_usage: bool) -> list[str]:
        """The SSE events of a batch of this choice's events; the last carries its
        finish_reason when the batch ends with the stats."""
        out = []
        p = self.advance(batch)
        if self.scores is not None:
            if p.text or p.logprobs:
                out.append(sse(shape.chunk(p.text, include_usage=include_usage,
                                           logprobs=p.logprobs, index=self.index)))
        elif p.text:
            out.append(shape.text_event(p.text, include_usage, self.index))
        if p.stats is not None:
            if p.rest:
                out.append(sse(shape.chunk(p.rest, include_usage=include_usage,
                                           index=self.index)))
            for i, call in enumerate(p.calls):  # each call whole, in a chunk of its own
                out.append(sse(shape.chunk(include_usage=include_usage, index=self.index,
                                           tool_calls=[{"index": i, **call}])))
            out.append(sse(shape.chunk(stats=p.stats, include_usage=include_usage,
                                       called=bool(p.calls), index=self.index)))
        return out


@dataclass
class Progress:
    """A batch of a choice's events, taken in: the text that may be shown now and its tokens'
    log-probabilities (those of held-back text too); with the last batch, its stats and, with
    tools, the held-back text that is no call (rest) and the calls (OpenAI's chat shape)."""

    text: str
    logprobs: dict | None
    stats: RequestStats | None = None
    rest: str | None = None
    calls: list[dict] = field(default_factory=list)


async def merged(choices: list[Choice], firsts: list[list]) -> AsyncIterator[tuple[Choice, list]]:
    """(choice, batch) as the choices' batches arrive, starting with each one's first batch;
    one choice's failure ends the merge with its error (the others are closed by the caller)."""
    if len(choices) == 1:  # the common case, without a task in between
        yield choices[0], firsts[0]
        if not isinstance(firsts[0][-1], RequestStats):
            async for batch in choices[0].events:
                yield choices[0], batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, first: list) -> None:
        try:
            await queue.put((choice, first))
            if not isinstance(first[-1], RequestStats):
                async for batch in choice.events:
                    await queue.put((choice, batch))
        except Exception as exc:
            await queue.put((choice, exc))

    tasks = [asyncio.create_task(pump(c, f)) for c, f in zip(choices, firsts)]
    open_choices = len(choices)
    try:
        while open_choices:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if isinstance(item[-1], RequestStats):
                open_choices -= 1
            yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
