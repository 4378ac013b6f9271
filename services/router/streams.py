"""From worker token streams to client-ready deltas.

`Choice` turns one generation's outputs (`TokenOut`) into `Delta`s: token ids detokenized incrementally, stop
strings matched across chunk boundaries and cut, the finish reason settled. `merge`
runs several choices at once (n > 1, batched prompts) and interleaves their deltas
under one deadline. Leaving `merge` early (client gone, error, deadline) cancels every
choice, which aborts their workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from baton.common.state import TokenLogprob
from baton.common.tokenizer import StopMatcher, Tokenizer
from baton.services.router.generation import Generation

_DONE = object()


@dataclass
class Delta:
    """What one choice adds to its answer; gathered with `add`, its whole answer (the
    body of a response that is not streamed)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # with the first tokens, when asked: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in a worker's prefix cache, so far
    stop_string: str | None = None  # the stop string that ended the answer, if one did

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        self.stop_string = delta.stop_string or self.stop_string


class Choice:
    """One generation as a stream of deltas. `tokenizer` None: token ids only, no text.
    `skip_special_tokens` False: special tokens stay in the text (a tool-call parser may
    need them), except the stop tokens that end the generation."""

    def __init__(
        self,
        index: int,
        generation: Generation,
        tokenizer: Tokenizer | None,
        stop_strings: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.index = index
        self.generation = generation
        self._tokenizer = tokenizer
        self._stops = StopMatcher(stop_strings)
        self._skip_special = skip_special_tokens
        self._hidden = (
            set() if skip_special_tokens else set(generation.request.sampling.stop_token_ids)
        )
        self.completion_tokens = 0
        self.first_token_at: float | None = None  # time.monotonic()
        self.finish_reason: str | None = None  # once its last delta went out

    @property
    def prompt_tokens(self) -> int:
        return len(self.generation.request.input_ids)

    async def deltas(self) -> AsyncIterator[Delta]:
        detokenizer = self._tokenizer.detokenizer(self._skip_special) if self._tokenizer else None
        async with aclosing(self.generation.outputs()) as outputs:
            async for output in outputs:
                if output.token_ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.completion_tokens += len(output.token_ids)
                delta = Delta(
                    self.index,
                    token_ids=output.token_ids,
                    logprobs=output.logprobs,
                    prompt_logprobs=output.prompt_logprobs,
                    cached_tokens=self.generation.cached_tokens,
                )
                if detokenizer is not None:
                    ids = output.token_ids
                    hidden = self._hidden
                    text = detokenizer.add([t for t in ids if t not in hidden] if hidden else ids)
                    if output.finish_reason:
                        text += detokenizer.flush()
                    delta.text, stopped = self._stops.add(text)
                    if stopped:
                        # Leaving the loop closes the generation, which aborts the workers.
                        delta.finish_reason = self.finish_reason = "stop"
                        delta.stop_string = self._stops.matched
                        yield delta
                        return
                if output.finish_reason:
                    delta.text += self._stops.flush()
                    delta.finish_reason = self.finish_reason = output.finish_reason
                if delta.text:
                    self.generation.timings.text_sent()
                if output.finish_reason:
                    yield delta
                    return
                if delta.text or delta.token_ids or delta.prompt_logprobs:
                    yield delta


async def merge(choices: Sequence[Choice], deadline: float | None) -> AsyncIterator[Delta]:
    """Deltas of all `choices` as they come. Raises the first choice's error, or
    TimeoutError once `deadline` (time.monotonic()) passes."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def drive(choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                queue.put_nowait(delta)
            queue.put_nowait(_DONE)
        except Exception as e:
            queue.put_nowait(e)

    loop = asyncio.get_running_loop()
    # The deadline on the loop's clock; the timeout covers each wait, never a yield (the
    # consumer's time between items belongs to the consumer's own task).
    loop_deadline = None if deadline is None else loop.time() + deadline - time.monotonic()
    tasks = [loop.create_task(drive(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            async with asyncio.timeout_at(loop_deadline):
                item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, Delta)
                yield item
    finally:
        # No awaiting here: this may run inside a cancelled scope (client gone). Each
        # task's own cancellation closes its generation and sends the aborts.
        for task in tasks:
            task.cancel()
