"""Typed configuration: validation at construction, and what crosses into the transfer layer."""

from __future__ import annotations

import pytest
import torch

from baton.common.config import EngineConfig, TransferConfig, transfer_backend_names
from baton.common.disagg import transfer_role
from baton.common.disagg.transfer_role import make_manager
from baton.common.transfer.base import Deadlines, KVArgs


def test_transfer_config_defaults_and_choices() -> None:
    cfg = TransferConfig()
    assert (cfg.backend, cfg.room_timeout, cfg.kv_control_port) == ("auto", 30.0, 0)
    assert {"auto", "ipc", "tcp", "fake"} <= set(transfer_backend_names())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"room_timeout": 0.0}, "room_timeout"),
        ({"kv_control_port": 70000}, "kv_control_port"),
        ({"fault": "fail:every=2"}, "fake backend"),  # a plan the tcp backend would ignore
    ],
)
def test_transfer_config_refuses_bad_values(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferConfig(**changes)  # type: ignore[arg-type]


def test_cluster_token_stays_out_of_logs() -> None:
    assert "s3cret" not in repr(TransferConfig(cluster_token="s3cret"))


def test_make_manager_hands_every_setting_to_the_transfer_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[tuple[KVArgs, str, str]] = []
    monkeypatch.setattr(transfer_role, "TransferManager", lambda *a: made.append(a))
    cfg = TransferConfig(
        backend="fake",
        host="10.0.0.1",
        advertise_host="w1",
        kv_control_port=5555,
        cluster_token="t",
        verify_checksum=True,
        room_timeout=7.0,
        fault="delay:ms=1",
    )
    make_manager(torch.zeros(4, 8), "decode", cfg)
    [(args, role, backend)] = made
    assert (role, backend, args.num_pages, args.page_bytes) == ("decode", "fake", 4, 32)
    assert (args.host, args.advertise_host, args.control_port) == ("10.0.0.1", "w1", 5555)
    assert (args.token, args.verify_checksum, args.fault_plan) == ("t", True, "delay:ms=1")
    assert args.deadlines == Deadlines(7.0, 7.0, 7.0)


def test_engine_dtype_resolves_to_torch() -> None:
    assert EngineConfig(model_path="m", dtype="bfloat16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_path="m", dtype="float8")
