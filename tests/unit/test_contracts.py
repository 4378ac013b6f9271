"""Cross-process contracts: what the router sends is what the scheduler runs, and what the
scheduler answers is what the router reads, field for field.

A field added to SamplingParams (or StatsOut, or TokenOut) and not to the protobuf
messages fails here, and so does one whose value is lost on the way.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from baton.common.protocol import (
    GenerateReq,
    OutputBatch,
    PeerInfo,
    StatsOut,
    TokenOut,
    decode_from_scheduler,
    decode_to_scheduler,
    encode,
    out_of_vocab,
)
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import (
    NOT_ON_RESPONSE,
    RESPONSE_RENAMED,
    SAMPLING_ON_REQUEST,
    TIMINGS,
    WORKER_ONLY_STATS,
    from_proto,
    load_to_proto,
    request_from_proto,
    request_to_proto,
    response_from_proto,
    response_to_proto,
    stats_to_proto,
)
from baton.common.sampling import GrammarSpec, SamplingParams
from baton.common.state import TokenLogprob
from baton.common.step_times import StepTimes

# A value other than the default for every field.
NOT_DEFAULT = {
    "max_new_tokens": 77,
    "min_new_tokens": 5,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "seed": 2**62 + 3,
    "stop_token_ids": [2, 9],
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 3,
    "logit_bias": {5: 1.5, 7: -100.0},
    "grammar": GrammarSpec("regex", "a+"),
    "prompt_logprobs": 2,
    "output_offset": 4,
}


def names(struct: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(struct)}


def proto_names(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_every_sampling_field_has_a_place_on_the_wire() -> None:
    on_request = set(SAMPLING_ON_REQUEST)
    assert names(SamplingParams) == proto_names(pb.SamplingParams) | on_request
    assert not proto_names(pb.SamplingParams) & on_request
    assert set(SAMPLING_ON_REQUEST.values()) <= proto_names(pb.GenerateRequest)
    assert set(NOT_DEFAULT) == names(SamplingParams)
    defaults = SamplingParams()
    assert all(getattr(defaults, k) != v for k, v in NOT_DEFAULT.items())


def router_to_scheduler(sampling: SamplingParams, room: int = 0) -> GenerateReq:
    peer = pb.PeerInfo(worker_id="d0", kv_control_address="tcp://10.0.0.2:5", transfer_address="t")
    wire = request_to_proto("r1", [3, 4, 5], sampling, room, peer if room else None)
    at_worker = request_from_proto(pb.GenerateRequest.FromString(wire.SerializeToString()))
    message = decode_to_scheduler(encode(at_worker))
    assert isinstance(message, GenerateReq)
    return message


def test_a_local_prompts_start_within_reaches_the_scheduler_and_is_validated() -> None:
    wire = request_to_proto("r1", [3, 4, 5], SamplingParams(), start_within=0.25)
    got = decode_to_scheduler(encode(request_from_proto(wire)))
    assert isinstance(got, GenerateReq) and got.start_within == 0.25
    assert request_from_proto(request_to_proto("r2", [3], SamplingParams())).start_within == 0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="start_within"):
            request_from_proto(request_to_proto("r3", [3], SamplingParams(), start_within=bad))


def test_every_sampling_field_survives_router_to_scheduler() -> None:
    sent = SamplingParams(**NOT_DEFAULT)  # type: ignore[arg-type]
    got = router_to_scheduler(sent, room=12345)
    assert got.sampling == sent
    assert (got.rid, got.input_ids, got.room) == ("r1", [3, 4, 5], 12345)
    assert got.peer == PeerInfo("d0", "tcp://10.0.0.2:5", "t")


def test_defaults_and_unset_optionals_survive_too() -> None:
    got = router_to_scheduler(SamplingParams())
    assert got.sampling == SamplingParams()
    assert got.sampling.seed is None and got.peer is None
    assert router_to_scheduler(SamplingParams(seed=0)).sampling.seed == 0


def test_stats_answers_carry_every_shared_field() -> None:
    assert names(StatsOut) == proto_names(pb.StatsResponse) | WORKER_ONLY_STATS
    assert proto_names(pb.Load) <= names(StatsOut)
    stats = StatsOut(
        running=3,
        queued=4,
        pages_free=5,
        pages_cached=6,
        pages_in_use=7,
        prefix_hit_tokens=8,
        prompt_tokens=9,
        token_usage=0.25,
        retracted=1,
        steps=2,
        step_times=StepTimes(1, 2, 3, 4, 5, 6),
        kv_bytes_sent=4096,
        kv_send_seconds=0.5,
        prefix_cache=True,
    )
    answer = stats_to_proto(stats)
    for name in proto_names(pb.StatsResponse):
        assert getattr(answer, name) == getattr(stats, name) or name == "step_times", name
    assert from_proto(answer.step_times, StepTimes) == stats.step_times
    load = load_to_proto(stats)
    assert (load.running, load.queued, load.token_usage) == (3, 4, 0.25)
    assert from_proto(load.step_times, StepTimes) == stats.step_times
    assert (load.kv_bytes_sent, load.kv_send_seconds, load.prefix_cache) == (4096, 0.5, True)


# A value other than the default for every field of a response (rid: the stream's own).
RESPONSE = TokenOut(
    rid="r1",
    token_ids=[7, 8],
    logprobs=[
        TokenLogprob(7, -0.25, [(7, -0.25), (3, -2.5)]),
        TokenLogprob(8, -1.5, [(1, -0.5), (8, -1.5)]),
    ],
    finished=True,
    finish_reason="length",
    error="a note",
    prompt_tokens=11,
    cached_tokens=4,
    completion_tokens=2,
    timings={
        "queue": 0.5,
        "prefill": 0.25,
        "kv_transfer": 0.125,
        "decode_admission": 0.0625,
        "ingress": 0.03125,
        "emit": 0.015625,
    },
    prompt_logprobs=[TokenLogprob(5, -3.0, [(4, -0.75)]), TokenLogprob(6, -0.125)],
)


def worker_to_router(out: TokenOut) -> TokenOut:
    """`out` from the scheduler process through the worker's frontend to the router."""
    at_frontend = decode_from_scheduler(encode(OutputBatch([out])))
    assert isinstance(at_frontend, OutputBatch)
    wire = response_to_proto(at_frontend.items[0])
    return response_from_proto(pb.GenerateResponse.FromString(wire.SerializeToString()), out.rid)


def test_every_response_field_has_a_place_on_the_wire() -> None:
    crossing = names(TokenOut) - NOT_ON_RESPONSE
    assert {RESPONSE_RENAMED.get(n, n) for n in crossing} == proto_names(pb.GenerateResponse)
    assert set(TIMINGS) == set(RESPONSE.timings)
    for field in msgspec.structs.fields(TokenOut):
        assert getattr(RESPONSE, field.name) != field.default, field.name


def test_every_response_field_survives_worker_to_router() -> None:
    assert worker_to_router(RESPONSE) == RESPONSE


def test_a_running_response_stays_running_and_untimed() -> None:
    running = TokenOut("r2", [9], [TokenLogprob(9, -0.5)], completion_tokens=3)
    assert worker_to_router(running) == running
    # a finish reason without `finished` is not a finish, and does not cross
    assert worker_to_router(TokenOut("r3", [], finish_reason="stop")) == TokenOut("r3", [])


def test_one_token_id_check() -> None:
    assert out_of_vocab([0, 5, 9], 10) == ""
    assert out_of_vocab([0, 10, -1], 10) == "token id 10 is outside the vocabulary [0, 10)"
