"""The JSON shapes of the three generation endpoints, streamed and whole.

One class per endpoint (completions, chat, native /generate) with the same four methods:
the chunks that open a stream, one chunk per delta, the last chunk (usage and
`baton_timings`), and the whole body of a non-streamed answer.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.router.streams import Delta


@dataclass
class ChoiceResult:
    """A choice's whole answer, gathered from its deltas (non-streamed responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason


class ResponseFormat(ABC):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def __init__(self, model: str, tokenizer: Tokenizer | None, top_logprobs: int | None) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self._tokenizer = tokenizer
        self.top_logprobs = top_logprobs  # None: no logprobs

    def opening_chunks(self, indices: list[int]) -> list[dict[str, Any]]:
        return []

    @abstractmethod
    def chunk(self, delta: Delta) -> dict[str, Any]: ...

    @abstractmethod
    def body(self, results: list[ChoiceResult]) -> dict[str, Any]: ...

    def closing_chunk(self) -> dict[str, Any]:
        """The chunk that carries usage and timings after every choice finished."""
        return self._envelope(self.chunk_object, [])

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _token_text(self, token_id: int) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionFormat(ResponseFormat):
    def __init__(self, model: str, tokenizer: Tokenizer | None, top_logprobs: int | None) -> None:
        super().__init__(model, tokenizer, top_logprobs)
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = {
            "index": delta.index,
            "text": delta.text,
            "logprobs": self._logprobs(delta.index, delta.logprobs),
            "finish_reason": delta.finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": r.index,
                "text": r.text,
                "logprobs": self._logprobs(r.index, r.logprobs),
                "finish_reason": r.finish_reason,
            }
            for r in results
        ]
        return self._envelope("text_completion", choices)

    def _logprobs(self, index: int, logprobs: list[pb.TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets = []
        offset = self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        top = [
            {self._token_text(t.token_id): t.logprob for t in lp.top_logprobs} for lp in logprobs
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": top if self.top_logprobs > 0 else None,
            "text_offset": offsets,
        }


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def opening_chunks(self, indices: list[int]) -> list[dict[str, Any]]:
        # The role comes first, before any token, as OpenAI's stream does.
        return [
            self._envelope(
                self.chunk_object,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in indices
        ]

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = {
            "index": delta.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": delta.finish_reason,
        }
        return self._envelope(self.chunk_object, [choice])

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": r.index,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": self._logprobs(r.logprobs),
                "finish_reason": r.finish_reason,
            }
            for r in results
        ]
        return self._envelope("chat.completion", choices)

    def _logprobs(self, logprobs: list[pb.TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [self._entry(lp) for lp in logprobs]}

    def _entry(self, lp: pb.TokenLogprob) -> dict[str, Any]:
        entry = self._alternative(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._alternative(t.token_id, t.logprob) for t in lp.top_logprobs]
        return entry

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class NativeFormat(ResponseFormat):
    """POST /generate: token ids only."""

    id_prefix = "gen-"
    chunk_object = "generate.chunk"

    def chunk(self, delta: Delta) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "token_ids": delta.token_ids,
            "finish_reason": delta.finish_reason,
        }
        if self.top_logprobs is not None:
            out["logprobs"] = [_native_logprob(lp) for lp in delta.logprobs]
        return out

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        (result,) = results
        out: dict[str, Any] = {
            "id": self.id,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
        }
        if self.top_logprobs is not None:
            out["logprobs"] = [_native_logprob(lp) for lp in result.logprobs]
        return out

    def closing_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "token_ids": [], "finish_reason": None}


def _native_logprob(lp: pb.TokenLogprob) -> dict[str, Any]:
    return {
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "top_logprobs": [[t.token_id, t.logprob] for t in lp.top_logprobs],
    }
