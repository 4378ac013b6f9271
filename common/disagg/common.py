"""What the prefill and decode handlers share: the KV manager set-up and the aux payload."""

from __future__ import annotations

from typing import Any

import msgspec

from baton.common.cache.kv_pool import KVPool
from baton.common.protocol import LogprobOut
from baton.common.transfer.base import Deadlines, KVArgs
from baton.common.transfer.manager import TransferManager


class FirstToken(msgspec.Struct, array_like=True):
    """P → D with the final transfer status: the first sampled token."""

    token_id: int
    logprob: LogprobOut | None = None


_aux_decoder = msgspec.msgpack.Decoder(FirstToken)


def encode_aux(first: FirstToken) -> bytes:
    return msgspec.msgpack.encode(first)


def decode_aux(data: bytes) -> FirstToken:
    return _aux_decoder.decode(data)


def make_manager(pool: KVPool, role: str, settings: dict[str, Any]) -> TransferManager:
    timeout = float(settings.get("room_timeout") or 30.0)
    args = KVArgs(
        buffer=pool.buffer,
        page_bytes=pool.page_bytes,
        num_pages=pool.num_pages,
        host=str(settings.get("host", "127.0.0.1")),
        advertise_host=settings.get("advertise_host") or None,
        control_port=int(settings.get("kv_control_port") or 0),
        token=str(settings.get("cluster_token") or ""),
        verify_checksum=bool(settings.get("verify_checksum", False)),
        deadlines=Deadlines(timeout, timeout, timeout),
        fault_plan=settings.get("fault"),
    )
    return TransferManager(args, role, str(settings.get("backend", "tcp")))  # type: ignore[arg-type]
