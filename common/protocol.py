"""Messages of the engine-internal plane (frontend ↔ scheduler, ZMQ over IPC).

msgspec Structs, tagged so one decoder reads any of them; no Python objects are ever
serialized onto a socket.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec

from baton.common.kv_events import PageEvent
from baton.common.sampling import SamplingParams
from baton.common.state import SpanRecord, TokenLogprob, Traceparent
from baton.common.step_times import StepTimes


class Role(str, enum.Enum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


def out_of_vocab(ids: Iterable[int], vocab_size: int) -> str:
    """What is wrong with token ids (the first outside [0, vocab_size)), or "" if nothing:
    one check for the router, the worker frontend and the scheduler."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    return "" if bad is None else f"token id {bad} is outside the vocabulary [0, {vocab_size})"


class PeerInfo(msgspec.Struct, frozen=True):
    worker_id: str
    kv_control_address: str
    transfer_address: str = ""


class GenerateReq(msgspec.Struct, tag="generate"):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    room: int = 0  # 0 = not disaggregated
    peer: PeerInfo | None = None
    traceparent: Traceparent | None = None  # traced: the worker's span of the request
    # time.monotonic() when the worker's frontend got the request (0: unknown); the same
    # host's clock as the scheduler's, which counts the hand-off as the request's `ingress`
    received_at: float = 0.0
    # placed on a decode worker whole (no room): seconds within which its first prompt
    # step must start, else it is handed back unstarted (`DecodeRole`); 0: no limit
    start_within: float = 0.0


class AbortReq(msgspec.Struct, tag="abort"):
    rid: str


class MigrateReq(msgspec.Struct, tag="migrate"):
    """Live migration: hand request `rid` off to decode worker `peer` in `room` at its next
    token that does not end it (`DecodeRole.on_migrate`); or, with `precopy_tokens`, only
    send the pages of the context's first `precopy_tokens` tokens while it decodes on."""

    rid: str
    room: int
    peer: PeerInfo
    precopy_tokens: int = 0


class MigrateOut(msgspec.Struct, tag="migrate_out"):
    """The scheduler's answer to `MigrateReq` (room `room`): taken, or why it was refused,
    so that the router falls back at once instead of waiting for a hand-off."""

    room: int
    refused: str = ""  # empty: the request will be handed off at its next token


class ConnectReq(msgspec.Struct, tag="connect"):
    """Open the KV data connections to decode worker `peer` now, ahead of a live
    migration's hand-off to it (`Role.connect`); answered by `ConnectOut` once they are."""

    peer: PeerInfo


class ConnectOut(msgspec.Struct, tag="connected"):
    transfer_address: str  # the peer's, as asked
    error: str = ""  # empty: open


class ShutdownReq(msgspec.Struct, tag="shutdown"):
    pass


class FlushCacheReq(msgspec.Struct, tag="flush_cache"):
    """Empty the prefix cache, unless requests are running or queued."""


class FlushCacheOut(msgspec.Struct, tag="flushed"):
    flushed: bool
    message: str = ""  # why not


class SwitchRoleReq(msgspec.Struct, tag="switch_role"):
    """Change the scheduler's role in place once it holds no request or room (waiting at
    most `timeout` seconds for that); answered by `SwitchRoleOut`."""

    role: str  # "prefill" | "decode" | "both"
    timeout: float


class SwitchRoleOut(msgspec.Struct, tag="switched_role"):
    """The role the scheduler now has and its KV-plane addresses; `error`: why it kept
    the old one."""

    role: str
    kv_control_address: str = ""
    transfer_address: str = ""
    error: str = ""


class PeerLostReq(msgspec.Struct, tag="peer_lost"):
    """A peer's lease lapsed: fail every room bound to its KV-control address."""

    kv_control_address: str


class TokenOut(msgspec.Struct, tag="tokens"):
    rid: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = []
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] = {}
    # with the first token, when asked: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] = []


class SpansOut(msgspec.Struct):
    """A traced request's spans recorded by the scheduler, sent with its finish (and, on
    P, once its room ended: the KV transfer outlives the request), in an OutputBatch."""

    rid: str
    traceparent: Traceparent  # the worker's span of the request
    spans: list[SpanRecord]


class StatsOut(msgspec.Struct, tag="stats"):
    running: int
    queued: int
    pages_free: int
    pages_cached: int
    pages_in_use: int
    prefix_hit_tokens: int
    prompt_tokens: int
    token_usage: float
    retracted: int
    steps: int
    decode_graph_steps: int = 0  # of `steps`, replayed from a CUDA graph (cumulative)
    prompt_graph_steps: int = 0
    piecewise_graph_steps: int = 0
    draw_graph_steps: int = 0
    mixed_steps: int = 0  # of `steps`, prompt tokens beside decode rows (cumulative)
    stalled_steps: int = 0  # of `steps`, far past the worker's own fit (cumulative)
    # what the router's placement model reads from a worker's load (pb.Load)
    step_times: StepTimes = msgspec.field(default_factory=StepTimes)
    kv_bytes_sent: float = 0.0  # cumulative, a prefill worker's
    kv_send_seconds: float = 0.0
    prefix_cache: bool = False
    extra: dict[str, float] = {}
    host_tier: HostTierStats | None = None  # with --host-kv-tokens
    gc_pauses: list[tuple[int, float]] = []  # (generation, seconds) since the last stats


class HostTierStats(msgspec.Struct):
    """The prefix cache's host-memory tier (`common/cache/host_tier.py`): totals to date,
    and its pages now."""

    hit_tokens: int  # prefix tokens loaded back from the host tier
    bytes_to_host: int
    bytes_to_device: int
    load_stall_seconds: float  # steps' forwards waiting for their loads
    dropped_pages: int  # host pages dropped, least recently used, to make room
    pages_used: int
    pages_total: int


class ReadyOut(msgspec.Struct, tag="ready"):
    """The scheduler process is up; PD workers report their KV-plane addresses."""

    kv_control_address: str = ""
    transfer_address: str = ""
    num_pages: int = 0
    error: str = ""


class OutputBatch(msgspec.Struct, tag="outputs"):
    items: list[TokenOut]
    # traced requests' records, handled before the items (a finish ends its stream); in
    # the step's one message, not one of their own (a message costs the frontend ~20 µs)
    spans: list[SpansOut] = []


class KVEventsOut(msgspec.Struct, tag="kv_events"):
    """The prefix cache's changes since the last message (sent only when there are some);
    the frontend numbers them and publishes them (`services/worker/kv_publisher.py`)."""

    created_at: float  # time.time() when the scheduler took them
    events: list[PageEvent]


ToScheduler = (
    GenerateReq
    | AbortReq
    | MigrateReq
    | ConnectReq
    | ShutdownReq
    | PeerLostReq
    | FlushCacheReq
    | SwitchRoleReq
)
FromScheduler = (
    OutputBatch
    | StatsOut
    | ReadyOut
    | FlushCacheOut
    | KVEventsOut
    | SwitchRoleOut
    | MigrateOut
    | ConnectOut
)

_to_sched_decoder = msgspec.msgpack.Decoder(ToScheduler)
_from_sched_decoder = msgspec.msgpack.Decoder(FromScheduler)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _to_sched_decoder.decode(data)


def decode_from_scheduler(data: bytes) -> FromScheduler:
    return _from_sched_decoder.decode(data)
