"""Sampling parameters: validated at the edge, trusted inside.

`SamplingParams` is a msgspec Struct so it crosses the engine-internal ZMQ plane as-is;
construction (and decoding from the wire) validates every field, and a bad value raises
`ValueError` naming the field.

`GrammarSpec` names a structured-output constraint (compiled on the worker by
`baton.common.layers.grammar`); the router turns every public spelling (response_format,
regex, choice...) into one of its three kinds.
"""

from __future__ import annotations

import math

import msgspec

_MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class GrammarSpec(msgspec.Struct, frozen=True):
    """A constraint on the generated text: a JSON schema (as JSON text), a regular
    expression, or an EBNF grammar (xgrammar's dialect, root rule `root`)."""

    kind: str
    value: str


INT32_MAX = 2**31 - 1  # integer fields travel as protobuf int32


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # token id -> value added to its logit before sampling, in [-100, 100]
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    grammar: GrammarSpec | None = None
    # None: no prompt logprobs; k >= 0: each prompt token's logprob and k alternatives
    prompt_logprobs: int | None = None
    # Set by the router when it resumes a generation on another worker: the last
    # `output_offset` prompt tokens are this generation's own earlier output. Sampling
    # continues at that output position of the seed's sequence and penalties count them
    # as output; max_new_tokens and min_new_tokens count only what is left.
    output_offset: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why} (got {getattr(self, name)!r})")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if not 0 <= self.max_new_tokens <= INT32_MAX:
            bad("max_new_tokens", f"must be in [0, {INT32_MAX}]")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            bad("min_new_tokens", "must be between 0 and max_new_tokens")
        if not -1 <= self.top_k <= INT32_MAX:
            bad("top_k", f"must be in [-1, {INT32_MAX}] (-1 or 0: disabled)")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", "must be in [0, 2**63)")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must be token ids in [0, 2**31)")
        if not 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {_MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_TOP_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {_MAX_TOP_LOGPROBS}]")
        if any(not 0 <= t <= INT32_MAX for t in self.logit_bias):
            bad("logit_bias", "keys must be token ids in [0, 2**31)")
        if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values()):
            bad("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            bad("grammar", f"kind must be one of {', '.join(GRAMMAR_KINDS)}")
        if not 0 <= self.output_offset <= INT32_MAX:
            bad("output_offset", f"must be in [0, {INT32_MAX}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def replace(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)
