"""A worker's registration record: the one schema every registry validates against.

The bootstrap service checks each `WorkerInfo` it is sent against `WorkerRecord`; the etcd
registry stores the record itself, msgspec-encoded JSON under `<prefix>/workers/<worker_id>`
(readable with `etcdctl get --prefix`), and validates every value it reads back - a value that
does not decode, or names another worker than its key, is logged and skipped.

The record mirrors `pb.WorkerInfo` field for field (tests/unit/test_registry_records.py keeps
them in step); the conversion goes through protobuf's JSON mapping, so roles read as names.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from google.protobuf import json_format

from baton.common.rpc import baton_pb2 as pb

MAX_ID_CHARS = 256
MAX_ADDRESS_CHARS = 1024

# A worker id is one path segment of an etcd key: no slash, no whitespace.
WorkerId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[^/\s]+$")]
# Where the router calls the worker: host:port or [v6]:port.
GrpcAddress = Annotated[
    str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS, pattern=r"^[^\s/]+:[0-9]{1,5}$")
]
# Other addresses are opaque to the registry (each transfer backend has its own form).
Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)]
# A decode worker's transfer address can describe several backends (`auto`'s offer, with a
# CUDA IPC export in it: about 600 characters).
MAX_TRANSFER_ADDRESS_CHARS = 4096
TransferAddress = Annotated[str, msgspec.Meta(max_length=MAX_TRANSFER_ADDRESS_CHARS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Amount = Annotated[float, msgspec.Meta(ge=0.0)]  # a cumulative count or sum of seconds


class RecordError(ValueError):
    """A record that does not validate."""


class LayoutRecord(msgspec.Struct, frozen=True):
    model: Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)] = ""
    page_size: Count = 0
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    num_layers: Count = 0
    num_kv_heads: Count = 0
    head_dim: Count = 0
    tp_size: Count = 0


class StepTimesRecord(msgspec.Struct, frozen=True):
    prefill_steps: Amount = 0.0
    prefill_tokens: Amount = 0.0
    prefill_seconds: Amount = 0.0
    decode_steps: Amount = 0.0
    decode_rows: Amount = 0.0
    decode_seconds: Amount = 0.0
    prefill_pairs: Amount = 0.0
    decode_slack: float = 0.0
    decode_pairs: Amount = 0.0
    slack_tokens: Amount = 0.0
    prefill_intercept: Amount = 0.0
    prefill_slope: Amount = 0.0
    prefill_attention: Amount = 0.0


class LoadRecord(msgspec.Struct, frozen=True):
    running: Count = 0
    queued: Count = 0
    token_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    step_times: StepTimesRecord = msgspec.field(default_factory=StepTimesRecord)
    kv_bytes_sent: Amount = 0.0
    kv_send_seconds: Amount = 0.0
    prefix_cache: bool = False


class CapacityRecord(msgspec.Struct, frozen=True):
    max_running_requests: Count = 0
    num_pages: Count = 0
    page_size: Count = 0


class WorkerRecord(msgspec.Struct, frozen=True):
    worker_id: WorkerId
    role: Literal["BOTH", "PREFILL", "DECODE"]
    grpc_address: GrpcAddress
    http_address: Address = ""
    kv_control_address: Address = ""
    transfer_address: TransferAddress = ""
    transfer_backend: Annotated[str, msgspec.Meta(max_length=32)] = ""
    layout: LayoutRecord = msgspec.field(default_factory=LayoutRecord)
    load: LoadRecord = msgspec.field(default_factory=LoadRecord)
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] = ""
    capacity: CapacityRecord = msgspec.field(default_factory=CapacityRecord)


def to_record(info: pb.WorkerInfo) -> WorkerRecord:
    """The record of `info`; RecordError names the first field that does not validate."""
    fields = json_format.MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    try:
        return msgspec.convert(fields, WorkerRecord)
    except msgspec.ValidationError as e:
        raise RecordError(f"worker {info.worker_id!r}: {e}") from None


def to_info(record: WorkerRecord) -> pb.WorkerInfo:
    return json_format.ParseDict(msgspec.to_builtins(record), pb.WorkerInfo())


def encode(record: WorkerRecord) -> bytes:
    return msgspec.json.encode(record)


def decode(value: bytes) -> WorkerRecord:
    """Validate and decode a stored value; RecordError says why it is unusable."""
    try:
        return msgspec.json.decode(value, type=WorkerRecord)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise RecordError(str(e)) from None
