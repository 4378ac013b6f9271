"""The router ↔ worker contract (gRPC), derived once from the engine's own types.

A converter copies the fields a protobuf message shares *by name* with a msgspec Struct,
driven by the field lists, so nothing is spelled twice: a field added to one side and not
to the other fails loudly here, and tests/unit/test_contracts.py checks every pair both
ways. What deliberately does not cross is named below, once.

    router: SamplingParams ── request_to_proto ──▶ pb.GenerateRequest
    worker: pb.GenerateRequest ── request_from_proto ──▶ GenerateReq (msgspec, to the
            scheduler process as-is)
    worker: StatsOut ── stats_to_proto / load_to_proto ──▶ pb.StatsResponse / pb.Load

The response travels back the same way, one converter per boundary; the scheduler's
TokenOut is what the router reads, and TokenLogprob is the one logprob on either side:

    worker: TokenOut (msgspec, from the scheduler process as-is) ── response_to_proto ──▶
            pb.GenerateResponse
    router: pb.GenerateResponse ── response_from_proto ──▶ TokenOut

KV events cross once, worker to router, field by field as a response does:

    worker: KVEventBatch ── kv_batch_to_proto ──▶ pb.KVEventBatch ── kv_batch_from_proto ──▶
            router: KVEventBatch

A response is spelled field by field (the router converts one per streamed message, so
it does without the descriptor walk of `to_proto`); tests/unit/test_contracts.py checks
that every field crosses and survives.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from baton.common.kv_events import KVEventBatch, PageEvent
from baton.common.protocol import GenerateReq, PeerInfo, StatsOut, TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.sampling import SamplingParams
from baton.common.state import TokenLogprob

S = TypeVar("S", bound=msgspec.Struct)
M = TypeVar("M")

# SamplingParams fields that travel on pb.GenerateRequest, beside pb.SamplingParams.
SAMPLING_ON_REQUEST = {"logprobs": "return_logprob", "top_logprobs": "top_logprobs"}
# StatsOut fields that stay inside the worker (its /metrics), in neither answer.
WORKER_ONLY_STATS = frozenset(
    {
        "retracted",
        "steps",
        "decode_graph_steps",
        "prompt_graph_steps",
        "piecewise_graph_steps",
        "draw_graph_steps",
        "mixed_steps",
        "stalled_steps",
        "extra",
        "host_tier",
        "gc_pauses",
    }
)
# TokenOut fields that do not cross: the stream names its request, and a response that
# finishes says so by its finish reason.
NOT_ON_RESPONSE = frozenset({"rid", "finished"})
# TokenOut fields named otherwise on pb.GenerateResponse.
RESPONSE_RENAMED = {"error": "error_message"}
# The phases of TokenOut.timings that cross (pb.Timings); the worker times no others.
TIMINGS = tuple(f.name for f in pb.Timings.DESCRIPTOR.fields)


def to_proto(source: object, message: M) -> M:
    """Fill every field of `message` from the attribute of `source` of the same name
    (a nested message from a nested Struct, a map from a dict)."""
    for field in message.DESCRIPTOR.fields:  # type: ignore[attr-defined]
        value = getattr(source, field.name)
        if value is None:  # an unset optional
            continue
        target = getattr(message, field.name)
        if _is_map(field):
            target.update(value)
        elif field.is_repeated:
            target.extend(value)
        elif field.message_type is not None:
            target.SetInParent()
            to_proto(value, target)
        else:
            setattr(message, field.name, value)
    return message


def from_proto(message: Any, cls: type[S], **given: Any) -> S:
    """A `cls` from the fields of `message` named like its own; `given` sets the others.
    An optional field left unset takes the Struct's default."""
    values = dict(given)
    for field in msgspec.structs.fields(cls):
        if field.name in given:
            continue
        descriptor = message.DESCRIPTOR.fields_by_name[field.name]
        if descriptor.has_presence and not message.HasField(field.name):
            continue
        value = getattr(message, field.name)
        if _is_map(descriptor):
            value = dict(value)
        elif descriptor.is_repeated:
            value = list(value)
        elif descriptor.message_type is not None:
            value = from_proto(value, _struct_of(field.type))
        values[field.name] = value
    return cls(**values)


def _is_map(field: Any) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _struct_of(annotation: Any) -> type[msgspec.Struct]:
    """The Struct class of a field typed `SomeStruct` or `SomeStruct | None`."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, msgspec.Struct):
            return candidate
    raise TypeError(f"{annotation!r} names no msgspec Struct")


def request_to_proto(
    request_id: str,
    input_ids: Sequence[int],
    sampling: SamplingParams,
    room: int = 0,
    peer: pb.PeerInfo | None = None,
    start_within: float = 0.0,
) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        request_id=request_id,
        input_ids=input_ids,
        sampling=to_proto(sampling, pb.SamplingParams()),
        room=room,
        peer=peer,
        start_within=start_within,
    )
    for name, on_request in SAMPLING_ON_REQUEST.items():
        setattr(message, on_request, getattr(sampling, name))
    return message


def request_from_proto(request: pb.GenerateRequest) -> GenerateReq:
    """Raises ValueError (naming the field) for sampling values the engine refuses."""
    extra = {name: getattr(request, on) for name, on in SAMPLING_ON_REQUEST.items()}
    if not extra["logprobs"]:
        extra["top_logprobs"] = 0
    sampling = from_proto(request.sampling, SamplingParams, **extra)
    peer = from_proto(request.peer, PeerInfo) if request.room else None
    if not math.isfinite(request.start_within) or request.start_within < 0:
        raise ValueError(f"start_within must be a finite number >= 0, got {request.start_within}")
    return GenerateReq(
        request.request_id,
        list(request.input_ids),
        sampling,
        request.room,
        peer,
        start_within=request.start_within,
    )


def stats_to_proto(stats: StatsOut) -> pb.StatsResponse:
    return to_proto(stats, pb.StatsResponse())


def load_to_proto(stats: StatsOut) -> pb.Load:
    return to_proto(stats, pb.Load())


def response_to_proto(out: TokenOut) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        token_ids=out.token_ids,
        finish_reason=out.finish_reason if out.finished else "",
        error_message=out.error,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
    )
    # Filled only when there is something to fill: an empty list costs protobuf as much as
    # the rest of a one-token message.
    if out.logprobs:
        message.logprobs.extend([_logprob_to_proto(lp) for lp in out.logprobs])
    if out.prompt_logprobs:
        message.prompt_logprobs.extend([_logprob_to_proto(lp) for lp in out.prompt_logprobs])
    if out.timings:
        timings = {k: v for k, v in out.timings.items() if k in TIMINGS}
        message.timings.CopyFrom(pb.Timings(**timings))
    return message


def response_from_proto(response: pb.GenerateResponse, rid: str) -> TokenOut:
    """`rid`: the request whose stream carried `response`."""
    timings = response.timings if response.HasField("timings") else None
    return TokenOut(
        rid,
        list(response.token_ids),
        _logprobs_from_proto(response.logprobs),
        finished=bool(response.finish_reason),
        finish_reason=response.finish_reason,
        error=response.error_message,
        prompt_tokens=response.prompt_tokens,
        cached_tokens=response.cached_tokens,
        completion_tokens=response.completion_tokens,
        timings={} if timings is None else {k: getattr(timings, k) for k in TIMINGS},
        prompt_logprobs=_logprobs_from_proto(response.prompt_logprobs),
    )


def _logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def _logprobs_from_proto(logprobs: Sequence[pb.TokenLogprob]) -> list[TokenLogprob]:
    if not logprobs:  # most messages: iterating an empty repeated field is not free
        return []
    return [
        TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
        for lp in logprobs
    ]


def kv_batch_to_proto(batch: KVEventBatch) -> pb.KVEventBatch:
    return pb.KVEventBatch(
        incarnation=batch.incarnation,
        seq=batch.seq,
        created_at=batch.created_at,
        page_size=batch.page_size,
        events=[
            pb.KVPageEvent(
                parent=e.parent,
                stored=e.stored,
                removed=e.removed,
                to_host=e.to_host,
                to_device=e.to_device,
            )
            for e in batch.events
        ],
        reset=batch.reset,
        complete=batch.complete,
        found_tokens=batch.found_tokens,
    )


def kv_batch_from_proto(message: pb.KVEventBatch) -> KVEventBatch:
    return KVEventBatch(
        incarnation=message.incarnation,
        seq=message.seq,
        created_at=message.created_at,
        page_size=message.page_size,
        events=[
            PageEvent(e.parent, list(e.stored), list(e.removed), list(e.to_host), list(e.to_device))
            for e in message.events
        ],
        reset=message.reset,
        complete=message.complete,
        found_tokens=message.found_tokens,
    )
