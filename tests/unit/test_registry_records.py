"""The worker record every registry validates, and the `--registry` settings."""

from __future__ import annotations

import msgspec
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.services.registry import records
from baton.services.registry.config import RegistryConfig, parse_etcd_url


def worker(**overrides: object) -> pb.WorkerInfo:
    fields: dict[str, object] = {
        "worker_id": "prefill-host-1a2b",
        "role": pb.PREFILL,
        "grpc_address": "10.0.0.2:9000",
        "http_address": "10.0.0.2:9100",
        "kv_control_address": "10.0.0.2:9200",
        "transfer_address": "10.0.0.2:9300",
        "transfer_backend": "tcp",
        "layout": pb.KVLayout(model="tiny", page_size=16, dtype="bfloat16", num_layers=2),
        "load": pb.Load(
            running=3,
            queued=1,
            token_usage=0.25,
            step_times=pb.StepTimes(prefill_steps=2, prefill_tokens=900, prefill_seconds=0.5),
            kv_bytes_sent=1 << 40,  # past an int32: kept a number
        ),
        "incarnation": "4f1c",
        "capacity": pb.Capacity(max_running_requests=64, num_pages=2048, page_size=16),
    }
    fields.update(overrides)
    return pb.WorkerInfo(**fields)  # type: ignore[arg-type]


def _fields(struct: type[msgspec.Struct]) -> set[str]:
    return set(struct.__struct_fields__)


def test_the_record_mirrors_worker_info_field_for_field() -> None:
    # A field added to WorkerInfo (or its parts) must be added to the record too, or etcd
    # would silently drop it.
    for struct, message in [
        (records.WorkerRecord, pb.WorkerInfo),
        (records.LayoutRecord, pb.KVLayout),
        (records.LoadRecord, pb.Load),
        (records.StepTimesRecord, pb.StepTimes),
        (records.CapacityRecord, pb.Capacity),
    ]:
        proto = {f.name for f in message.DESCRIPTOR.fields}
        assert _fields(struct) == proto, (
            f"services/registry/records.py {struct.__name__} and {message.__name__} differ: "
            f"add {sorted(proto - _fields(struct))}, drop {sorted(_fields(struct) - proto)}"
        )


def test_a_record_round_trips_through_its_stored_json() -> None:
    info = worker()
    stored = records.encode(records.to_record(info))
    assert b'"role":"PREFILL"' in stored  # readable with etcdctl
    assert records.to_info(records.decode(stored)) == info


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        (worker(worker_id=""), "worker_id"),
        (worker(worker_id="a/b"), "worker_id"),
        (worker(worker_id="x" * 300), "worker_id"),
        (worker(role=pb.ROLE_UNSPECIFIED), "role"),
        (worker(grpc_address=""), "grpc_address"),
        (worker(grpc_address="no-port"), "grpc_address"),
    ],
)
def test_a_worker_that_could_never_be_used_is_refused(info: pb.WorkerInfo, reason: str) -> None:
    with pytest.raises(records.RecordError, match=reason):
        records.to_record(info)


@pytest.mark.parametrize(
    "stored",
    [
        b"not json",
        b'{"worker_id": 3}',
        b'{"worker_id": "w", "role": "SOMETHING", "grpc_address": "h:1"}',
        b'{"worker_id": "w", "role": "DECODE", "grpc_address": "h:1", "load": {"running": -1}}',
    ],
)
def test_a_malformed_stored_value_does_not_decode(stored: bytes) -> None:
    with pytest.raises(records.RecordError):
        records.decode(stored)


def test_etcd_urls_name_endpoints_and_a_prefix() -> None:
    assert parse_etcd_url("etcd://10.0.0.5:2379,etcd-1,etcd-2:12379/baton/prod") == (
        [("10.0.0.5", 2379), ("etcd-1", 2379), ("etcd-2", 12379)],
        "/baton/prod",
    )
    assert parse_etcd_url("etcd://etcd")[1] == "/baton"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("etcd://root:secret@etcd:2379", "never in the --registry URL"),
        ("etcd://", "not HOST"),
        ("etcd://[::1]:2379", "IPv4"),
        ("etcd://h:port", "not HOST"),
        ("nohostport", "expected HOST:PORT"),
        ("http://h:1", "expected HOST:PORT"),
    ],
)
def test_bad_registry_urls_are_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        RegistryConfig(url)


def test_the_password_stays_out_of_the_settings_repr() -> None:
    config = RegistryConfig("etcd://h:1", username="baton", password="s3cret")
    assert "s3cret" not in repr(config)
    with pytest.raises(ValueError, match="etcd registry only"):
        RegistryConfig("h:1", username="baton")
