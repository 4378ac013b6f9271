"""From a validated request body to what the cluster runs: prompts as token ids and one
engine `SamplingParams` per choice.

Everything that can be wrong with a request is found here, before any worker is asked:
an unknown model name, a prompt too long for the context, token ids outside the
vocabulary, sampling values the engine refuses, a bad schema, a documented field this
server does not honor. Each raises an `APIError` (400/404) naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from baton.common.protocol import out_of_vocab
from baton.common.sampling import GrammarSpec, SamplingParams
from baton.common.tokenizer import Tokenizer
from baton.services.router.config import ModelInfo
from baton.services.router.errors import APIError, bad_request, model_not_found
from baton.services.router.limits import PromptLimit
from baton.services.router.schemas import (
    MAX_N,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from baton.services.router.structured import grammar_from_fields
from baton.services.router.tool_parsers import ToolParser
from baton.services.router.tools import NO_TOOLS, ToolPlan, plan_tools, template_messages

log = logging.getLogger(__name__)

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
    echo: bool = False  # completions: the prompt comes before the completion
    prompt_logprobs: int | None = None  # None: no prompt logprobs asked
    tools: ToolPlan = NO_TOOLS
    skip_special_tokens: bool = True
    prompt_texts: list[str | None] | None = None  # completions: each prompt as sent, if text
    continuous_usage: bool = False  # a stream's every chunk carries the usage so far

    @property
    def n(self) -> int:
        return len(self.choices) // self.prompt_count


@dataclass
class Knobs:
    """What a request asks beyond the shared sampling fields."""

    max_tokens: int | None
    top_logprobs: int | None
    grammar: GrammarSpec | None = None
    prompt_logprobs: int | None = None


class RequestPreparer:
    def __init__(self, model: ModelInfo, tokenizer: Tokenizer, tool_parser: ToolParser) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.prompt_limit = PromptLimit(model.context_len, tokenizer.vocabulary())

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise model_not_found(name, self.model.name)

    def completion(self, body: CompletionRequest) -> PreparedRequest:
        self.check_model(body.model)
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        prompts = self._completion_prompts(body.prompt)
        if isinstance(body.prompt, str):
            texts: list[str | None] = [body.prompt]
        else:
            texts = [p if isinstance(p, str) else None for p in body.prompt]
            texts = texts if len(texts) == len(prompts) else [None]
        echo = bool(body.echo)
        asked = [
            k for k in (body.prompt_logprobs, body.logprobs if echo else None) if k is not None
        ]
        knobs = Knobs(
            body.max_tokens,
            body.logprobs,
            grammar_from_fields(body),
            max(asked) if asked else None,
        )
        prepared = self._prepare(body, prompts, knobs)
        return _replace(
            prepared, echo=echo, prompt_logprobs=knobs.prompt_logprobs, prompt_texts=texts
        )

    def chat(self, body: ChatCompletionRequest) -> PreparedRequest:
        self.check_model(body.model)
        _refuse_unhonored(body)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        tools = plan_tools(body, self.tool_parser)
        grammar = grammar_from_fields(body)
        if tools.grammar is not None:
            if grammar is not None:
                raise bad_request(
                    "tool_choice required or a named function cannot be combined with a "
                    "structured-output constraint",
                    param="tool_choice",
                )
            grammar = tools.grammar
        prompt = self.chat_prompt(
            template_messages(body.messages),
            tools.template_tools,
            body.add_generation_prompt is not False,
            body.chat_template_kwargs,
        )
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        knobs = Knobs(max_tokens, top_logprobs, grammar, body.prompt_logprobs)
        prepared = self._prepare(body, [prompt], knobs)
        return _replace(
            prepared,
            tools=tools,
            prompt_logprobs=body.prompt_logprobs,
            skip_special_tokens=not (
                tools.parser is not None and tools.parser.needs_special_tokens
            ),
        )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        """The chat template applied to the messages and tools, as token ids."""
        texts = [_text(m.get("content")) for m in messages]
        if self.prompt_limit.too_long("".join(texts)):
            raise APIError(
                400,
                f"messages are longer than this model's context of {self.model.context_len} "
                f"tokens could hold ({self.prompt_limit.max_bytes} bytes at most)",
                param="messages",
                code="context_length_exceeded",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as e:  # a template may reject roles or orderings it does not know
            raise bad_request(f"messages: the chat template refused them: {e}", "messages") from e

    # -- shared ------------------------------------------------------------------------------

    def _prepare(
        self, body: SamplingFields, prompts: list[list[int]], knobs: Knobs
    ) -> PreparedRequest:
        n = body.n or 1
        if n * len(prompts) > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        if body.stream_options is not None and body.stream_options.include_obfuscation:
            raise bad_request(
                "stream_options.include_obfuscation is not supported",
                "stream_options.include_obfuscation",
            )
        if body.user is not None:
            log.info("request for user %r", body.user)
        stops = body.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        stop_ids = list(body.stop_token_ids or [])
        self.check_token_ids(stop_ids, "stop_token_ids")
        if not body.ignore_eos:
            # The tokenizer's end-of-turn tokens end a generation even where the worker's
            # own defaults would not know them.
            stop_ids += sorted(set(self.tokenizer.eos_token_ids) - set(stop_ids))
        logit_bias = self.logit_bias(body.logit_bias)
        choices: list[ChoiceSpec] = []
        for prompt in prompts:
            budget = knobs.max_tokens if knobs.max_tokens is not None else self.room_left(prompt)
            self.check_context(len(prompt), budget, "max_tokens")
            for _ in range(n):
                index = len(choices)
                seed = None if body.seed is None else (body.seed + index % n) % 2**63
                fields = self._fields(body, budget, seed, stop_ids, knobs)
                fields["logit_bias"] = logit_bias
                choices.append(ChoiceSpec(index, prompt, self.sampling(fields)))
        return PreparedRequest(
            choices=choices,
            prompt_count=len(prompts),
            stop_strings=stops,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            top_logprobs=knobs.top_logprobs,
            continuous_usage=body.continuous_usage,
        )

    def _fields(
        self,
        body: SamplingFields,
        max_tokens: int,
        seed: int | None,
        stop_ids: list[int],
        knobs: Knobs,
    ) -> dict[str, Any]:
        if (body.min_tokens or 0) > max_tokens:
            raise bad_request("min_tokens must not exceed max_tokens", param="min_tokens")
        return {
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
            "logprobs": knobs.top_logprobs is not None,
            "top_logprobs": knobs.top_logprobs or 0,
            "grammar": knobs.grammar,
            "prompt_logprobs": knobs.prompt_logprobs,
        }

    def sampling(self, fields: dict[str, Any]) -> SamplingParams:
        """Engine sampling parameters; a value the engine refuses is a 400 naming it."""
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=_PUBLIC_NAMES.get(name, name)) from e

    def logit_bias(
        self, bias: dict[str, float] | None, param: str = "logit_bias"
    ) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"{param}: keys must be token ids, got {key!r}", param) from None
            self.check_token_ids([token], param)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise bad_request(f"{param}: values must be numbers", param)
            out[token] = float(value)
        return out

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode_text(prompt, "prompt")]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(prompt) > MAX_CHOICES and not isinstance(prompt[0], int):
            raise bad_request(f"at most {MAX_CHOICES} prompts per request", param="prompt")
        prompts: list[list[int]] = []
        if isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            for item in prompt:
                prompts.append(
                    self.encode_text(item, "prompt") if isinstance(item, str) else list(item)
                )
        for ids in prompts:
            self.check_prompt(ids, "prompt")
        return prompts

    def encode_text(self, text: str, param: str) -> list[int]:
        """`text` as token ids. A text too long for the context by its size alone is refused
        before the tokenizer sees it; a tokenizer error is the request's fault (400)."""
        if self.prompt_limit.too_long(text):
            raise APIError(
                400,
                f"{param} is longer than this model's context of {self.model.context_len} "
                f"tokens could hold ({self.prompt_limit.max_bytes} bytes at most)",
                param=param,
                code="context_length_exceeded",
            )
        try:
            return self.tokenizer.encode(text)
        except Exception as e:
            raise bad_request(f"{param}: the tokenizer refused it: {e}", param) from e

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request(f"{param} must not be empty", param=param)
        self.check_token_ids(ids, param)

    def room_left(self, prompt: list[int]) -> int:
        # At least 1, so that a prompt filling the context reports the overflow below.
        return max(self.model.context_len - len(prompt), 1)

    def check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
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

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if error := out_of_vocab(ids, self.model.vocab_size):
            raise bad_request(f"{param}: {error}", param)


def _refuse_unhonored(body: ChatCompletionRequest) -> None:
    """Documented OpenAI chat fields this server cannot honor: a 400 when they ask for
    anything (their null or neutral values are fine)."""
    refused = {
        "store": body.store is True,
        "metadata": bool(body.metadata),
        "modalities": body.modalities not in (None, ["text"]),
        "audio": body.audio is not None,
        "prediction": body.prediction is not None,
        "reasoning_effort": body.reasoning_effort is not None,
        "verbosity": body.verbosity is not None,
        "web_search_options": body.web_search_options is not None,
        "service_tier": body.service_tier not in (None, "auto", "default"),
        "prompt_cache_key": body.prompt_cache_key is not None,
        "functions": body.functions is not None,
        "function_call": body.function_call is not None,
    }
    hints = {
        "store": "completions are never stored",
        "metadata": "completions are never stored",
        "functions": "use tools",
        "function_call": "use tool_choice",
    }
    for name, asked in refused.items():
        if asked:
            hint = f" ({hints[name]})" if name in hints else ""
            raise bad_request(f"{name} is not supported by this server{hint}", param=name)
    if body.safety_identifier is not None:
        log.info("request for safety identifier %r", body.safety_identifier)


def _replace(prepared: PreparedRequest, **changes: Any) -> PreparedRequest:
    import dataclasses

    return dataclasses.replace(prepared, **changes)


def _or(value: object, default: object) -> object:
    return default if value is None else value


def _text(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(t for t in parts if isinstance(t, str))
    return ""
