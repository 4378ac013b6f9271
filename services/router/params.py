"""From a validated request body to what the cluster runs: prompts as token ids and one
engine `SamplingParams` per choice.

Everything that can be wrong with a request is found here, before any worker is asked:
an unknown model name, a prompt too long for the context, token ids outside the
vocabulary, sampling values the engine refuses. Each raises an `APIError` (400/404).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from baton.common.sampling import SamplingParams
from baton.common.tokenizer import Tokenizer
from baton.services.router.config import ModelInfo
from baton.services.router.errors import APIError, bad_request, model_not_found
from baton.services.router.schemas import (
    MAX_N,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
)

MAX_CHOICES = 2 * MAX_N  # prompts in a batch x n

# The engine's field names where the public API spells them differently.
_PUBLIC_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    input_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    choices: list[ChoiceSpec]
    prompt_count: int  # choices are grouped by prompt: prompt i has choices i*n .. i*n+n-1
    stop_strings: list[str]
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs asked

    @property
    def n(self) -> int:
        return len(self.choices) // self.prompt_count


class RequestPreparer:
    def __init__(self, model: ModelInfo, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise model_not_found(name, self.model.name)

    def completion(self, body: CompletionRequest) -> PreparedRequest:
        self.check_model(body.model)
        if body.echo:
            raise bad_request("echo is not supported", param="echo")
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        prompts = self._completion_prompts(body.prompt)
        return self._prepare(body, prompts, body.max_tokens, body.logprobs)

    def chat(self, body: ChatCompletionRequest) -> PreparedRequest:
        self.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        messages = [m.for_template() for m in body.messages]
        try:
            prompt = self.tokenizer.apply_chat_template(messages)
        except Exception as e:  # a template may reject roles or orderings it does not know
            raise bad_request(f"messages: the chat template refused them: {e}", "messages") from e
        max_tokens = body.max_completion_tokens or body.max_tokens
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._prepare(body, [prompt], max_tokens, top_logprobs)

    def generate(self, body: GenerateRequest) -> PreparedRequest:
        """The native endpoint: engine sampling fields as they are, token ids only."""
        unknown = set(body.sampling_params) - set(SamplingParams.__struct_fields__)
        if unknown:
            raise bad_request(
                f"sampling_params: unknown fields {sorted(unknown)}", "sampling_params"
            )
        self._check_token_ids(body.input_ids, "input_ids")
        fields = dict(body.sampling_params)
        fields.setdefault("max_new_tokens", self._room_left(body.input_ids))
        try:
            sampling = msgspec.convert(fields, SamplingParams)
        except msgspec.ValidationError as e:
            raise bad_request(f"sampling_params: {e}", "sampling_params") from e
        self._check_context(len(body.input_ids), sampling.max_new_tokens, "max_new_tokens")
        self._check_token_ids(sampling.stop_token_ids, "sampling_params.stop_token_ids")
        return PreparedRequest(
            choices=[ChoiceSpec(0, list(body.input_ids), sampling)],
            prompt_count=1,
            stop_strings=[],
            stream=body.stream,
            include_usage=True,
            top_logprobs=sampling.top_logprobs if sampling.logprobs else None,
        )

    # -- shared ------------------------------------------------------------------------------

    def _prepare(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        top_logprobs: int | None,
    ) -> PreparedRequest:
        n = body.n or 1
        if n * len(prompts) > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        stops = body.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        stop_ids = list(body.stop_token_ids or [])
        self._check_token_ids(stop_ids, "stop_token_ids")
        if not body.ignore_eos:
            # The tokenizer's end-of-turn tokens end a generation even where the worker's
            # own defaults would not know them.
            stop_ids += sorted(set(self.tokenizer.eos_token_ids) - set(stop_ids))
        choices: list[ChoiceSpec] = []
        for prompt in prompts:
            budget = max_tokens if max_tokens is not None else self._room_left(prompt)
            self._check_context(len(prompt), budget, "max_tokens")
            for _ in range(n):
                index = len(choices)
                seed = None if body.seed is None else (body.seed + index % n) % 2**63
                sampling = self._sampling(body, budget, seed, stop_ids, top_logprobs)
                choices.append(ChoiceSpec(index, prompt, sampling))
        return PreparedRequest(
            choices=choices,
            prompt_count=len(prompts),
            stop_strings=stops,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            top_logprobs=top_logprobs,
        )

    def _sampling(
        self,
        body: SamplingFields,
        max_tokens: int,
        seed: int | None,
        stop_ids: list[int],
        top_logprobs: int | None,
    ) -> SamplingParams:
        fields: dict[str, object] = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": min(body.min_tokens or 0, max_tokens),
            "temperature": _or(body.temperature, 1.0),
            "top_p": _or(body.top_p, 1.0),
            "top_k": _or(body.top_k, -1),
            "min_p": _or(body.min_p, 0.0),
            "repetition_penalty": _or(body.repetition_penalty, 1.0),
            "frequency_penalty": _or(body.frequency_penalty, 0.0),
            "presence_penalty": _or(body.presence_penalty, 0.0),
            "seed": seed,
            "stop_token_ids": stop_ids,
            "ignore_eos": bool(body.ignore_eos),
            "logprobs": top_logprobs is not None,
            "top_logprobs": top_logprobs or 0,
        }
        if (body.min_tokens or 0) > max_tokens:
            raise bad_request("min_tokens must not exceed max_tokens", param="min_tokens")
        try:
            return SamplingParams(**fields)  # type: ignore[arg-type]
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=_PUBLIC_NAMES.get(name, name)) from e

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(prompt) > MAX_CHOICES and not isinstance(prompt[0], int):
            raise bad_request(f"at most {MAX_CHOICES} prompts per request", param="prompt")
        prompts: list[list[int]] = []
        if isinstance(prompt[0], int):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            for item in prompt:
                prompts.append(self.tokenizer.encode(item) if isinstance(item, str) else list(item))  # type: ignore[arg-type]
        for ids in prompts:
            if not ids:
                raise bad_request("prompt must not be empty", param="prompt")
            self._check_token_ids(ids, "prompt")
        return prompts

    def _room_left(self, prompt: list[int]) -> int:
        # At least 1, so that a prompt filling the context reports the overflow below.
        return max(self.model.context_len - len(prompt), 1)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        context = self.model.context_len
        if prompt_len + max_tokens > context:
            raise APIError(
                400,
                f"this model's maximum context length is {context} tokens; the request asks "
                f"for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} "
                "for the completion); shorten the prompt or lower the token limit",
                param=param if prompt_len < context else "prompt",
                code="context_length_exceeded",
            )

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.model.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise bad_request(
                f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param
            )


def _or(value: object, default: object) -> object:
    return default if value is None else value
