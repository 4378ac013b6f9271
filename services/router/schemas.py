"""Request bodies of the public API, as pydantic models (FastAPI validates them).

Strict types: a string where a number belongs is a 400, not a silent conversion. Fields
OpenAI allows to be null are Optional here and take their default when null. A field this
server does not know is a 400 naming it (never accepted and ignored); documented OpenAI
fields that it cannot honor are declared here and refused in `params` when set. Range
checks that need the model (context length, vocabulary) happen later, in `params`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.common.sampling import INT32_MAX

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 100.0

# Every number is bounded: integers travel to the workers as protobuf int32.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Request(_Body):
    """A whole request body: its text must be valid Unicode everywhere (a lone surrogate
    escape such as "\\ud800" is valid JSON, but no tokenizer can encode it and no answer
    could carry it back)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate(data, "")
        if where is not None:
            raise ValueError(
                f"{where or 'the body'}: text must be valid Unicode (a lone surrogate)"
            )
        return data


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string under `value` that is not valid Unicode, else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items: Any = [(str(k), k) for k in value] + [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(item, f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


class StreamOptions(_Body):
    include_usage: bool | None = False
    # vLLM's: usage (tokens so far) in every chunk, not only in a last one (guidellm asks it)
    continuous_usage_stats: bool | None = False
    # Padding against side channels; a stream of this server has none to hide.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class StructuredFields(_Body):
    """Every public spelling of a structured-output constraint (at most one per request)."""

    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    structured_outputs: StructuredOutputs | None = None  # vLLM
    # vLLM's older names for the same constraints
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class SamplingFields(StructuredFields, _Request):
    """What completions and chat share: the model, sampling, stopping, streaming."""

    model: str
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    user: str | None = None  # an end-user id: logged with the request
    # Extensions beyond OpenAI's API, as other open servers spell them.
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1 or 0: no top-k
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_PENALTY)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    # A string, a list of strings (a batch), token ids, or a list of token-id lists.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    # Documented by OpenAI, refused in `params` unless they ask for nothing:
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    # Keys beyond these go to the chat template as they are (it uses what it knows).
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None  # like `user`: logged with the request
    # vLLM's chat-template controls
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    # Documented by OpenAI, refused in `params` unless they ask for nothing:
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """vLLM's two forms: a `prompt`, or chat `messages` (with the template's options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class GenerateRequest(_Request):
    """SGLang's native endpoint: text or token ids in, text and `meta_info` out; a list
    of texts (or of token-id lists) is a batch."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    # from which prompt position input logprobs are returned; -1 (default): none
    logprob_start_len: int = Field(default=-1, ge=-1, le=INT32_MAX)
    return_text_in_logprobs: bool = False  # each logprob's token text, else null
    rid: str | list[str] | None = None
