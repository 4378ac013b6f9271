"""What the prefill and decode roles share: the KV manager, room intake, peer loss,
statistics, and the first-token payload P sends D with the final status."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import torch

from baton.common.cache.kv_pool import KVPool
from baton.common.config import TransferConfig
from baton.common.disagg.aggregated_role import Role, trace
from baton.common.distributed import tp
from baton.common.distributed.wire import KVWire
from baton.common.protocol import GenerateReq, SpansOut
from baton.common.state import FinishReason, Req, SpanValue, TokenLogprob
from baton.common.transfer.base import Deadlines, KVArgs, KVRoomHandle
from baton.common.transfer.manager import TransferManager


class FirstToken(msgspec.Struct, array_like=True):
    """P → D with the final transfer status: the first sampled token."""

    token_id: int
    logprob: TokenLogprob | None = None


log = logging.getLogger(__name__)

H = TypeVar("H", bound=KVRoomHandle)

_aux_decoder = msgspec.msgpack.Decoder(FirstToken)


def encode_aux(first: FirstToken) -> bytes:
    return msgspec.msgpack.encode(first)


def decode_aux(data: bytes) -> FirstToken:
    return _aux_decoder.decode(data)


def make_manager(buffer: torch.Tensor, role: str, config: TransferConfig) -> TransferManager:
    """A KV manager over `buffer`: the page-major pool (or, with TP, rank 0's full-head
    wire buffer), so one page is one contiguous run of bytes whatever the TP size."""
    timeout = config.room_timeout
    args = KVArgs(
        buffer=buffer,
        page_bytes=buffer[0].numel() * buffer.element_size(),
        num_pages=buffer.shape[0],
        host=config.host,
        advertise_host=config.advertise_host,
        control_port=config.kv_control_port,
        token=config.cluster_token or "",
        verify_checksum=config.verify_checksum,
        deadlines=Deadlines(timeout, timeout, timeout),
        fault_plan=config.fault,
    )
    return TransferManager(args, role, config.backend)  # type: ignore[arg-type]


class TransferRole(Role):
    """What the prefill and decode roles share: the KV manager, peer loss, statistics."""

    def __init__(self, pool: KVPool, num_kv_heads: int, config: TransferConfig, role: str) -> None:
        self.page_size = pool.page_size
        # TP: the transfer layer moves full-head pages through rank 0's wire buffer
        self.kv_wire = KVWire(pool, num_kv_heads, holder=True) if tp().size > 1 else None
        buffer = self.kv_wire.buffer if self.kv_wire is not None else pool.buffer
        assert buffer is not None
        self.manager = make_manager(buffer, role, config)
        self.kv_control_address = self.manager.control_address
        self.transfer_address = self.manager.transfer_address or ""
        self.failures: dict[str, int] = {}
        self.page_bytes = buffer[0].numel() * buffer.element_size()
        self.backend = str(self.manager.stats().get("backend", config.backend))
        self.late_spans: list[SpansOut] = []

    def admit_room(
        self, msg: GenerateReq, role_name: str, peer_name: str, create: Callable[[int, str], H]
    ) -> tuple[Req, H] | None:
        """A validated request and its room handle, or None when the request ended here
        (no room or peer; invalid for this worker: then the peer is told at once rather
        than at its deadline)."""
        req = self.port.new_request(msg.rid, msg.input_ids, msg.sampling, msg.received_at)
        if msg.peer is None or not msg.room:
            if not req.finished:
                req.error = f"a {role_name} worker needs a room and a {peer_name} peer"
                self.port.finish(req, FinishReason.ERROR)
            return None
        handle = create(msg.room, msg.peer.kv_control_address)
        if req.finished:
            handle.abort(req.error or f"refused by the {role_name} worker")
            handle.release()
            return None
        trace(req, msg)
        handle.trace_context = msg.traceparent
        return req, handle

    def trace_room(
        self,
        req: Req,
        name: str,
        start: float,
        handle: KVRoomHandle,
        detached: bool,
        **more: SpanValue,
    ) -> None:
        """The traced `req`'s span of its room's KV transfer, from `start` to now, linked
        to the peer's span of the room; `detached` (P, after the request's output ended:
        the scheduler forgot it), sent on its own."""
        spans = req.trace
        if spans is None:
            return
        reason = handle.failure_reason
        attributes: dict[str, SpanValue] = {
            "baton.room": str(handle.room),
            "baton.kv.backend": handle.backend or self.backend,
            "baton.kv.outcome": "ok" if reason is None else reason,
            **more,
        }
        spans.add(name, start, time.monotonic(), attributes, handle.peer_trace_context)
        if detached:
            self.late_spans.append(SpansOut(req.rid, spans.traceparent, spans.take()))

    def take_spans(self) -> list[SpansOut] | None:
        if not self.late_spans:
            return None
        spans, self.late_spans = self.late_spans, []
        return spans

    def on_peer_lost(self, kv_control_address: str) -> None:
        n = self.manager.fail_peer(kv_control_address, "peer lost: its lease lapsed")
        if n:
            log.warning("failed %d room(s) bound to lost peer %s", n, kv_control_address)

    def count_failure(self, reason: str) -> None:
        key = reason.split(":")[0][:40]
        self.failures[key] = self.failures.get(key, 0) + 1

    def queue_stats(self) -> dict[str, float]:
        """Sizes of the role's queues; `queued_disagg` counts toward the worker's queue."""
        return {}

    def stats(self) -> dict[str, float]:
        out = self.queue_stats()
        for key, value in self.manager.stats().items():
            if isinstance(value, int | float):
                out[f"kv_{key}"] = float(value)
            elif isinstance(value, dict):  # e.g. seconds spent in each room state
                for sub, v in value.items():
                    if isinstance(v, int | float):
                        out[f"kv_{key}:{sub}"] = float(v)
        for reason, n in self.failures.items():
            out[f"room_failed:{reason}"] = n
        return out

    def shutdown(self) -> None:
        self.manager.shutdown()
