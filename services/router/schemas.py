"""Request bodies of the public API, as pydantic models (FastAPI validates them).

Strict types: a string where a number belongs is a 400, not a silent conversion. Fields
OpenAI allows to be null are Optional here and take their default when null. Unknown
fields are ignored, as most OpenAI-compatible servers do, so that clients sending newer
OpenAI fields keep working. Range checks that need the model (context length, vocabulary)
happen later, in `params`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What completions and chat share: the model, sampling, stopping, streaming."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # Extensions beyond OpenAI's API, as other open servers spell them.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # A string, a list of strings (a batch), token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Not strict about extra keys (tool calls, names): the template sees what it knows.
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        content: str | list[dict[str, Any]]
        if isinstance(self.content, list):
            content = [part.model_dump() for part in self.content]
        else:
            content = self.content or ""
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class GenerateRequest(_Body):
    """The native endpoint: token ids in, token ids out, the engine's sampling fields."""

    input_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
