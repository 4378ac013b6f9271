"""The committed protobuf/gRPC stubs match proto/baton.proto and import as a package."""

from __future__ import annotations

from pathlib import Path

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc import gen


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    gen.generate(tmp_path)
    for name in gen.GENERATED:
        committed = (gen.RPC_DIR / name).read_bytes()
        fresh = (tmp_path / name).read_bytes()
        assert committed == fresh, (
            f"common/rpc/{name} is stale: run `python -m baton.common.rpc.gen`"
        )


def test_grpc_stub_uses_the_package_messages() -> None:
    # A top-level `import baton_pb2` would fail outside common/rpc or load a second copy.
    assert pb_grpc.baton__pb2 is pb


def test_generate_request_round_trips_and_seed_is_optional() -> None:
    request = pb.GenerateRequest(
        request_id="r1",
        input_ids=[1, 2, 3],
        sampling=pb.SamplingParams(temperature=0.7, top_k=-1, max_new_tokens=8),
        room=(1 << 63) - 1,
        peer=pb.PeerInfo(worker_id="d0", kv_control_address="tcp://127.0.0.1:1"),
    )
    parsed = pb.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.sampling.temperature == 0.7  # double: no float32 rounding
    assert not parsed.sampling.HasField("seed")
    parsed.sampling.seed = 0
    again = pb.GenerateRequest.FromString(parsed.SerializeToString())
    assert again.sampling.HasField("seed") and again.sampling.seed == 0
