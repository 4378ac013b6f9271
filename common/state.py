"""State types: requests, scheduled batches and their outputs.

These live below `cache/` and `engine/`: the cache manager, the scheduler, the model
runner and the roles all speak them; this module imports nothing of theirs.

One length vocabulary (docs/ARCHITECTURE.md §5):
  cached_len   tokens whose KV came from the prefix cache (page-aligned, locked nodes)
  device_len   tokens whose KV exists or is being computed by an in-flight step
  extend_len   tokens computed in one step
  output_len   tokens generated so far
A request's known tokens are `input_ids + output_ids`; while decoding, `device_len` is one
less than that (the newest token is the next step's input).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import msgspec

from baton.common.sampling import SamplingParams

if TYPE_CHECKING:
    from baton.common.cache.radix import RadixNode
    from baton.common.devices import Ints
    from baton.common.layers.grammar import Matcher
    from baton.common.layers.penalties import PenaltyState


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    MIGRATED = "migrated"  # handed off to another worker (live migration): not an end
    # a prompt placed on a decode worker, not started within its `start_within`: the
    # router places it again (not an end either)
    HANDED_BACK = "handed_back"


class TokenLogprob(msgspec.Struct, array_like=True):
    """One token's logprob and, when asked, the most likely alternatives, best first, as
    (token id, logprob). The one logprob type from the sampler to the router: it crosses
    the ZMQ planes as itself (msgspec) and the gRPC plane through `common.rpc.convert`."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


# A W3C trace context (`traceparent`, version 00), as it crosses the ZMQ planes and the
# KV control messages: anything else fails the message's decoding.
Traceparent = Annotated[
    str, msgspec.Meta(pattern=r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$", max_length=55)
]
SpanValue = str | int | float | bool


class SpanRecord(msgspec.Struct, array_like=True, frozen=True):
    """One span the scheduler process recorded for a traced request, as plain values: the
    worker's frontend makes it an OpenTelemetry span (services/worker/tracing.py)."""

    name: str
    start: float  # time.monotonic() (the host's clock: the frontend converts)
    end: float
    attributes: dict[str, SpanValue] = {}
    links: list[Traceparent] = []  # related spans of other processes (a room's peer)


class RequestSpans:
    """A traced request's spans, recorded where the scheduler sees them happen; None on an
    untraced request, so that tracing off costs one test per place that could record.

    ```
    prompt chunk   launched ────────── computed       baton.prefill.chunk (tokens, cached)
    retracted (D)  ───────── in a launched step again  baton.retracted
    ```
    The roles add their KV transfer's span (`add`)."""

    __slots__ = ("_chunks", "_retracted", "retractions", "spans", "traceparent")

    def __init__(self, traceparent: str) -> None:
        self.traceparent = traceparent  # the worker's span of the request
        self.spans: list[SpanRecord] = []
        self.retractions = 0
        self._chunks: dict[int, float] = {}  # launched chunks by their end: launch time
        self._retracted: float | None = None

    def add(
        self,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, SpanValue],
        link: str | None = None,
    ) -> None:
        self.spans.append(SpanRecord(name, start, end, attributes, [link] if link else []))

    def launched(self, item: ScheduledItem) -> None:
        """A step with the request in it was launched."""
        now = time.monotonic()
        if self._retracted is not None:  # computed again
            self.add("baton.retracted", self._retracted, now, {})
            self._retracted = None
        if item.end <= len(item.req.input_ids):  # a chunk of the prompt
            self._chunks[item.end] = now

    def chunk_computed(self, item: ScheduledItem) -> None:
        launched = self._chunks.pop(item.end, None)
        if launched is None:
            return
        cached = item.req.prefix_hit_tokens
        attributes: dict[str, SpanValue] = {
            "baton.chunk_tokens": item.extend_len,
            "baton.prefix_tokens": item.prefix_len,  # KV that existed before the chunk
            "baton.cached_tokens": cached if item.prefix_len <= cached else 0,  # the first's
            "baton.last_chunk": item.sample,
        }
        self.add("baton.prefill.chunk", launched, time.monotonic(), attributes)

    def retracted(self) -> None:
        self.retractions += 1
        self._retracted = time.monotonic()

    def take(self) -> list[SpanRecord]:
        spans, self.spans = self.spans, []
        return spans


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # when asked: entry i is prompt token i+1's logprob given tokens 0..i (from prefill)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: Matcher | None = None  # structured output: where the outputs are in it
    finish_reason: FinishReason | None = None
    error: str = ""
    # memory (owned by CacheManager)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    node: RadixNode | None = None
    cached_len: int = 0
    device_len: int = 0
    # scheduling
    prefix_hit_tokens: int = 0  # prefix-cache hit at the latest admission
    in_flight: int = 0  # sampled tokens not yet seen by the host
    future: int = 0  # future-map index of the newest in-flight token (0 = none)
    suspect: bool = False  # was in a failed step: computed alone until a step succeeds
    # owed pages in the prefill queue: it had some (retracted, requeued) or was refused, and
    # its prompt is not all in; a decode worker's rooms must not take them first
    # (`PrefillManager.short_of_memory`)
    short_of_pages: bool = False
    penalty: PenaltyState | None = None
    times: dict[str, float] = field(default_factory=dict)
    trace: RequestSpans | None = None  # traced (the worker's frontend asked): its spans

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known or in flight: prompt + outputs (incl. in-flight samples)."""
        return len(self.input_ids) + len(self.output_ids) + self.in_flight

    @property
    def output_len(self) -> int:
        return len(self.output_ids) + self.in_flight

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def can_stop(self) -> bool:
        """It may end before its max_new_tokens: on a stop token, or its grammar's end."""
        return bool(self.stop_ids) or self.grammar is not None

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to be computed: it must not reuse cached KV."""
        return self.sampling.prompt_logprobs is not None and not self.output_ids


@dataclass
class ScheduledItem:
    """One request's share of a step: which of its tokens are computed, and whether the
    step samples its next token."""

    req: Req
    prefix_len: int  # tokens whose KV exists before this step
    extend_len: int  # tokens computed by this step
    sample: bool  # False for a prefill chunk that is not the prompt's last
    kv_slots: Ints  # the KV slots its extend tokens write (numpy for more than one)

    @property
    def end(self) -> int:
        """Tokens whose KV exists once the step ran."""
        return self.prefix_len + self.extend_len


@dataclass
class ScheduledBatch:
    """What one step computes: one item per request."""

    items: list[ScheduledItem] = field(default_factory=list)
    solo: bool = False  # a suspect's step: nothing else runs with it

    @property
    def is_decode(self) -> bool:
        return all(it.extend_len == 1 for it in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(it.extend_len for it in self.items)

    @property
    def reqs(self) -> list[Req]:
        return [it.req for it in self.items]


@dataclass
class GenerateOutput:
    rid: str
    output_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    error: str = ""
    prompt_logprobs: list[TokenLogprob] | None = None
