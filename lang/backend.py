"""The contract between a program's states and the server they run against.

A state calls its backend from its own thread, so many states (forks, a batch) call one
backend at the same time: implementations are thread-safe. Failures raise
`EndpointError` carrying the server's message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.lang.chat_template import ChatTemplate


@dataclass(frozen=True)
class Generation:
    text: str
    # the server's meta_info: prompt_tokens, completion_tokens, cached_tokens, finish_reason...
    meta_info: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    @abstractmethod
    def generate(
        self,
        text: str,
        sampling: dict[str, Any],
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Generate after `text` with `/generate` sampling params. With `on_text`, stream:
        it is called with each new piece of text as it arrives (in order; together they
        are the result's text)."""

    @abstractmethod
    def choice_logprobs(self, text: str, choices: Sequence[str]) -> list[list[float]]:
        """For each choice, the logprob of each of its tokens following `text` (the prompt
        computed once, the choices after it)."""

    @abstractmethod
    def cache_prefix(self, text: str) -> None:
        """Compute `text` once, so that requests extending it (forks) find it cached."""

    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """How role blocks render for the served model."""
