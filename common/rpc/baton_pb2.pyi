from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    BOTH: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
BOTH: Role
PREFILL: Role
DECODE: Role

class Grammar(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "max_new_tokens", "min_new_tokens", "stop_token_ids", "ignore_eos", "logit_bias", "grammar", "prompt_logprobs", "output_offset")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logit_bias: _containers.ScalarMap[int, float]
    grammar: Grammar
    prompt_logprobs: int
    output_offset: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., output_offset: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("worker_id", "kv_control_address", "transfer_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_control_address: str
    transfer_address: str
    def __init__(self, worker_id: _Optional[str] = ..., kv_control_address: _Optional[str] = ..., transfer_address: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling", "room", "peer", "return_logprob", "top_logprobs", "start_within")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    START_WITHIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    room: int
    peer: PeerInfo
    return_logprob: bool
    top_logprobs: int
    start_within: float
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., room: _Optional[int] = ..., peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., start_within: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue", "prefill", "kv_transfer", "decode_admission", "ingress", "emit")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    INGRESS_FIELD_NUMBER: _ClassVar[int]
    EMIT_FIELD_NUMBER: _ClassVar[int]
    queue: float
    prefill: float
    kv_transfer: float
    decode_admission: float
    ingress: float
    emit: float
    def __init__(self, queue: _Optional[float] = ..., prefill: _Optional[float] = ..., kv_transfer: _Optional[float] = ..., decode_admission: _Optional[float] = ..., ingress: _Optional[float] = ..., emit: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "error_message", "prompt_tokens", "completion_tokens", "cached_tokens", "timings", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    error_message: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., error_message: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "room", "peer", "precopy_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    room: int
    peer: PeerInfo
    precopy_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., room: _Optional[int] = ..., peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., precopy_tokens: _Optional[int] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "role", "status")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    role: str
    status: str
    def __init__(self, ok: _Optional[bool] = ..., role: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("flushed", "message")
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    flushed: bool
    message: str
    def __init__(self, flushed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_seconds")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    drain_timeout_seconds: float
    def __init__(self, role: _Optional[str] = ..., drain_timeout_seconds: _Optional[float] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role", "previous_role", "kv_control_address", "transfer_address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous_role: str
    kv_control_address: str
    transfer_address: str
    def __init__(self, role: _Optional[str] = ..., previous_role: _Optional[str] = ..., kv_control_address: _Optional[str] = ..., transfer_address: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("running", "queued", "pages_free", "pages_cached", "pages_in_use", "prefix_hit_tokens", "prompt_tokens", "token_usage", "step_times", "kv_bytes_sent", "kv_send_seconds", "prefix_cache")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    running: int
    queued: int
    pages_free: int
    pages_cached: int
    pages_in_use: int
    prefix_hit_tokens: int
    prompt_tokens: int
    token_usage: float
    step_times: StepTimes
    kv_bytes_sent: float
    kv_send_seconds: float
    prefix_cache: bool
    def __init__(self, running: _Optional[int] = ..., queued: _Optional[int] = ..., pages_free: _Optional[int] = ..., pages_cached: _Optional[int] = ..., pages_in_use: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., token_usage: _Optional[float] = ..., step_times: _Optional[_Union[StepTimes, _Mapping]] = ..., kv_bytes_sent: _Optional[float] = ..., kv_send_seconds: _Optional[float] = ..., prefix_cache: _Optional[bool] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("incarnation", "from_seq")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    from_seq: int
    def __init__(self, incarnation: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class KVPageEvent(_message.Message):
    __slots__ = ("parent", "stored", "removed", "to_host", "to_device")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TO_HOST_FIELD_NUMBER: _ClassVar[int]
    TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    parent: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    to_host: _containers.RepeatedScalarFieldContainer[int]
    to_device: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parent: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., to_host: _Optional[_Iterable[int]] = ..., to_device: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("incarnation", "seq", "created_at", "page_size", "events", "reset", "complete", "found_tokens")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    seq: int
    created_at: float
    page_size: int
    events: _containers.RepeatedCompositeFieldContainer[KVPageEvent]
    reset: bool
    complete: bool
    found_tokens: int
    def __init__(self, incarnation: _Optional[str] = ..., seq: _Optional[int] = ..., created_at: _Optional[float] = ..., page_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVPageEvent, _Mapping]]] = ..., reset: _Optional[bool] = ..., complete: _Optional[bool] = ..., found_tokens: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "page_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "tp_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    page_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    def __init__(self, model: _Optional[str] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "queued", "token_usage", "step_times", "kv_bytes_sent", "kv_send_seconds", "prefix_cache")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    running: int
    queued: int
    token_usage: float
    step_times: StepTimes
    kv_bytes_sent: float
    kv_send_seconds: float
    prefix_cache: bool
    def __init__(self, running: _Optional[int] = ..., queued: _Optional[int] = ..., token_usage: _Optional[float] = ..., step_times: _Optional[_Union[StepTimes, _Mapping]] = ..., kv_bytes_sent: _Optional[float] = ..., kv_send_seconds: _Optional[float] = ..., prefix_cache: _Optional[bool] = ...) -> None: ...

class StepTimes(_message.Message):
    __slots__ = ("prefill_steps", "prefill_tokens", "prefill_seconds", "decode_steps", "decode_rows", "decode_seconds", "prefill_pairs", "decode_slack", "decode_pairs", "slack_tokens", "prefill_intercept", "prefill_slope", "prefill_attention")
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PAIRS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SLACK_FIELD_NUMBER: _ClassVar[int]
    DECODE_PAIRS_FIELD_NUMBER: _ClassVar[int]
    SLACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INTERCEPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SLOPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    prefill_steps: float
    prefill_tokens: float
    prefill_seconds: float
    decode_steps: float
    decode_rows: float
    decode_seconds: float
    prefill_pairs: float
    decode_slack: float
    decode_pairs: float
    slack_tokens: float
    prefill_intercept: float
    prefill_slope: float
    prefill_attention: float
    def __init__(self, prefill_steps: _Optional[float] = ..., prefill_tokens: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., decode_steps: _Optional[float] = ..., decode_rows: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., prefill_pairs: _Optional[float] = ..., decode_slack: _Optional[float] = ..., decode_pairs: _Optional[float] = ..., slack_tokens: _Optional[float] = ..., prefill_intercept: _Optional[float] = ..., prefill_slope: _Optional[float] = ..., prefill_attention: _Optional[float] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("max_running_requests", "num_pages", "page_size")
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_running_requests: int
    num_pages: int
    page_size: int
    def __init__(self, max_running_requests: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "http_address", "kv_control_address", "transfer_address", "transfer_backend", "layout", "load", "incarnation", "capacity")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    grpc_address: str
    http_address: str
    kv_control_address: str
    transfer_address: str
    transfer_backend: str
    layout: KVLayout
    load: Load
    incarnation: str
    capacity: Capacity
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., grpc_address: _Optional[str] = ..., http_address: _Optional[str] = ..., kv_control_address: _Optional[str] = ..., transfer_address: _Optional[str] = ..., transfer_backend: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., incarnation: _Optional[str] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl_seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease_id", "worker_id", "load")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    load: Load
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("lease_id", "worker_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("type", "worker", "lease_ttl_seconds")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[MembershipEvent.Type]
        ADDED: _ClassVar[MembershipEvent.Type]
        UPDATED: _ClassVar[MembershipEvent.Type]
        REMOVED: _ClassVar[MembershipEvent.Type]
        SYNCED: _ClassVar[MembershipEvent.Type]
    TYPE_UNSPECIFIED: MembershipEvent.Type
    ADDED: MembershipEvent.Type
    UPDATED: MembershipEvent.Type
    REMOVED: MembershipEvent.Type
    SYNCED: MembershipEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    type: MembershipEvent.Type
    worker: WorkerInfo
    lease_ttl_seconds: float
    def __init__(self, type: _Optional[_Union[MembershipEvent.Type, str]] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...
