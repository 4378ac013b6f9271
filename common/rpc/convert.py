"""The router ↔ worker contract (gRPC), derived once from the engine's own types.

A converter copies the fields a protobuf message shares *by name* with a msgspec Struct,
driven by the field lists, so nothing is spelled twice: a field added to one side and not
to the other fails loudly here, and tests/unit/test_contracts.py checks every pair both
ways. What deliberately does not cross is named below, once.

    router: SamplingParams ── request_to_proto ──▶ pb.GenerateRequest
    worker: pb.GenerateRequest ── request_from_proto ──▶ GenerateReq (msgspec, to the
            scheduler process as-is)
    worker: StatsOut ── stats_to_proto / load_to_proto ──▶ pb.StatsResponse / pb.Load
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from baton.common.protocol import GenerateReq, PeerInfo, StatsOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.sampling import SamplingParams

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
        "draw_graph_steps",
        "extra",
    }
)


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
) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        request_id=request_id,
        input_ids=input_ids,
        sampling=to_proto(sampling, pb.SamplingParams()),
        room=room,
        peer=peer,
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
    return GenerateReq(request.request_id, list(request.input_ids), sampling, request.room, peer)


def stats_to_proto(stats: StatsOut) -> pb.StatsResponse:
    return to_proto(stats, pb.StatsResponse())


def load_to_proto(stats: StatsOut) -> pb.Load:
    return to_proto(stats, pb.Load())
