"""The JSON shapes of the OpenAI generation endpoints, streamed and whole.

One class per endpoint (completions, chat; SGLang's /generate lives in `sglang`) with
the same four methods: the chunks that open a stream, one chunk per delta, the last
chunk (usage and `baton_timings`), and the whole body of a non-streamed answer (each
choice's deltas gathered into one, `Delta.add`).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any

from baton.common.state import TokenLogprob
from baton.common.tokenizer import Tokenizer
from baton.services.router.params import PreparedRequest
from baton.services.router.streams import Delta
from baton.services.router.tool_answers import ToolAnswer


class ResponseFormat(ABC):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def __init__(self, model: str, tokenizer: Tokenizer, prepared: PreparedRequest) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self._tokenizer = tokenizer
        self.prepared = prepared
        self.top_logprobs = prepared.top_logprobs  # None: no logprobs

    def opening_chunks(self, indices: list[int]) -> list[dict[str, Any]]:
        return []

    @abstractmethod
    def chunk(self, delta: Delta) -> dict[str, Any]: ...

    @abstractmethod
    def body(self, results: list[Delta]) -> dict[str, Any]: ...

    def whole(self, results: list[Delta], usage: dict[str, Any], timings: dict[str, Any]) -> Any:
        """The JSON of a response that is not streamed: `body`, then `finalize`."""
        body = self.body(results)
        self.finalize(body, usage, timings)
        return body

    def closing_chunk(self) -> dict[str, Any]:
        """The chunk that carries usage and timings after every choice finished."""
        return self._envelope(self.chunk_object, [])

    def finalize(
        self, body: dict[str, Any], usage: dict[str, Any], timings: dict[str, Any]
    ) -> None:
        """Add usage and timings to a whole (non-streamed) body."""
        body["usage"] = usage
        body["baton_timings"] = timings

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_ids(self, index: int) -> list[int]:
        return self.prepared.choices[index].input_ids

    def _vllm_prompt_logprobs(
        self, index: int, logprobs: list[TokenLogprob]
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map
        from token id to {logprob, rank, decoded_token} (the token and its alternatives)."""
        if self.prepared.prompt_logprobs is None or not logprobs:
            return None
        out: list[dict[str, Any] | None] = [None]
        for lp in logprobs:
            entry: dict[str, Any] = {}
            ranked = [token_id for token_id, _ in lp.top]
            for i, (token_id, logprob) in enumerate(lp.top[: self.prepared.prompt_logprobs]):
                entry[str(token_id)] = self._vllm_logprob(token_id, logprob, i + 1)
            if str(lp.token_id) not in entry:
                own = ranked.index(lp.token_id) + 1 if lp.token_id in ranked else None
                entry[str(lp.token_id)] = self._vllm_logprob(lp.token_id, lp.logprob, own)
            out.append(entry)
        return out

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token_id)}


class CompletionFormat(ResponseFormat):
    def __init__(self, model: str, tokenizer: Tokenizer, prepared: PreparedRequest) -> None:
        super().__init__(model, tokenizer, prepared)
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        self._started: set[int] = set()  # choices whose first chunk went out

    def chunk(self, delta: Delta) -> dict[str, Any]:
        return self._envelope("text_completion", [self._choice(delta)])

    def body(self, results: list[Delta]) -> dict[str, Any]:
        return self._envelope("text_completion", [self._choice(r) for r in results])

    def _choice(self, delta: Delta) -> dict[str, Any]:
        first = delta.index not in self._started
        self._started.add(delta.index)
        text = delta.text
        logprobs = self._logprobs(delta.index, delta.logprobs)
        if first and self.prepared.echo:
            prompt_text, prompt_lps = self._echo(delta.index, delta.prompt_logprobs)
            text = prompt_text + text
            if logprobs is not None and prompt_lps is not None:
                logprobs = {key: prompt_lps[key] + logprobs[key] for key in logprobs}
        choice: dict[str, Any] = {
            "index": delta.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }
        if first and self.prepared.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(
                delta.index, delta.prompt_logprobs
            )
        return choice

    def _echo(
        self, index: int, prompt_logprobs: list[TokenLogprob]
    ) -> tuple[str, dict[str, Any] | None]:
        ids = self._prompt_ids(index)
        texts = self.prepared.prompt_texts or [None]
        given = texts[index // self.prepared.n] if index // self.prepared.n < len(texts) else None
        text = given if given is not None else self._tokenizer.decode(ids)
        if self.top_logprobs is None:
            return text, None
        # The first prompt token has no context to be predicted from: null, as OpenAI's.
        tokens = [self._token_text(t) for t in ids]
        top: list[dict[str, float] | None] = [None]
        top += [self._top(lp) for lp in prompt_logprobs]
        offsets = []
        offset = 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = len(text)
        return text, {
            "tokens": tokens,
            "token_logprobs": [None, *(lp.logprob for lp in prompt_logprobs)],
            "top_logprobs": top if self.top_logprobs > 0 else None,
            "text_offset": offsets,
        }

    def _top(self, lp: TokenLogprob) -> dict[str, float]:
        alternatives = lp.top[: self.top_logprobs or 0]
        return {self._token_text(token_id): logprob for token_id, logprob in alternatives}

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets = []
        offset = self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [self._top(lp) for lp in logprobs] if self.top_logprobs > 0 else None,
            "text_offset": offsets,
        }


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, tokenizer: Tokenizer, prepared: PreparedRequest) -> None:
        super().__init__(model, tokenizer, prepared)
        self._answers: dict[int, ToolAnswer] = {}
        self._started: set[int] = set()

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
        answer = self._answer(delta.index)
        content, calls = answer.add(delta.text)
        finish_reason = delta.finish_reason
        if finish_reason is not None:
            rest, more_calls, finish_reason = answer.finish(finish_reason)
            content += rest
            calls += more_calls
        message: dict[str, Any] = {"content": content} if content else {}
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": delta.index,
            "delta": message,
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": finish_reason,
        }
        out = self._envelope(self.chunk_object, [choice])
        self._add_prompt_logprobs(out, delta.index, delta.prompt_logprobs)
        return out

    def body(self, results: list[Delta]) -> dict[str, Any]:
        choices = []
        for r in results:
            answer = self._answer(r.index)
            content, calls = answer.add(r.text)
            rest, more_calls, finish_reason = answer.finish(r.finish_reason or "stop")
            content += rest
            calls += more_calls
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [_whole_call(c) for c in calls]
            choices.append(
                {
                    "index": r.index,
                    "message": message,
                    "logprobs": self._logprobs(r.logprobs),
                    "finish_reason": finish_reason if r.finish_reason else None,
                }
            )
        out = self._envelope("chat.completion", choices)
        if results:
            self._add_prompt_logprobs(out, results[0].index, results[0].prompt_logprobs)
        return out

    def _answer(self, index: int) -> ToolAnswer:
        if index not in self._answers:
            self._answers[index] = ToolAnswer(self.prepared.tools)
        return self._answers[index]

    def _add_prompt_logprobs(
        self, out: dict[str, Any], index: int, logprobs: list[TokenLogprob]
    ) -> None:
        if self.prepared.prompt_logprobs is not None and index not in self._started and logprobs:
            self._started.add(index)
            out["prompt_logprobs"] = self._vllm_prompt_logprobs(index, logprobs)

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [self._entry(lp) for lp in logprobs]}

    def _entry(self, lp: TokenLogprob) -> dict[str, Any]:
        entry = self._alternative(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._alternative(t, v) for t, v in lp.top]
        return entry

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _whole_call(delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed tool-call delta (which carries every part) as a message's tool call."""
    return {"id": delta["id"], "type": "function", "function": delta["function"]}
