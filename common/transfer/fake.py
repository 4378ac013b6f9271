"""The `fake` backend, for tests: moves data exactly like `tcp`, and applies a fault plan
(``KVArgs.fault_plan``; grammar in ``faults``). Only the sending side applies it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from baton.common.transfer.backend import DataConnection, Outbound, RegionSink
from baton.common.transfer.base import KVArgs, PeerLostError, TransferError
from baton.common.transfer.faults import FaultPlan
from baton.common.transfer.messages import DataHello, encode_frame
from baton.common.transfer.regions import ByteBuffer
from baton.common.transfer.tcp import TcpBackend, TcpConnection, send_buffers


class FakeConnection(TcpConnection):
    backend = "fake"

    def __init__(self, backend: FakeBackend, address: str, hello: DataHello, timeout_s: float):
        super().__init__(address, hello, timeout_s)
        self._backend = backend

    def push(self, source: ByteBuffer, items: Sequence[Outbound]) -> None:
        if not items or not self._backend.hits(items[0].frame.room, "corrupt"):
            super().push(source, items)
            return
        try:
            for item in items:
                payload = bytearray(
                    source.slice(item.src_offset, item.frame.length).cpu().numpy().tobytes()
                )
                payload[0] ^= 0xFF
                send_buffers(self.sock, [memoryview(encode_frame(item.frame)), memoryview(payload)])
        except OSError as exc:
            raise PeerLostError(f"send: {exc}") from exc


class FakeBackend(TcpBackend):
    name = "fake"

    def __init__(self, plan: FaultPlan | None = None) -> None:
        super().__init__()
        self.plan = plan
        self._lock = threading.Lock()
        self._ordinals: dict[int, int] = {}

    def start(self, args: KVArgs, sink: RegionSink | None) -> str | None:
        if self.plan is None:
            self.plan = FaultPlan.parse(args.fault_plan or "")
        return super().start(args, sink)

    def connect(self, address: str, hello: DataHello) -> DataConnection:
        return FakeConnection(self, address, hello, self._stall_timeout_s)

    def hits(self, room: int, kind: str) -> bool:
        """Whether fault ``kind`` (fail, drop, corrupt) applies to ``room``."""
        ordinal = self._ordinal(room)
        every = getattr(self.plan, f"{kind}_every", 0)
        return bool(every) and ordinal % every == 0

    def _ordinal(self, room: int) -> int:
        with self._lock:
            return self._ordinals.setdefault(room, len(self._ordinals) + 1)

    def before_push(self, room: int) -> None:
        if self.plan is not None and self.plan.delay_ms:
            time.sleep(self.plan.delay_ms / 1000)
        if self.hits(room, "fail"):
            raise TransferError("fake fault: fail")

    def deliver_done(self, room: int) -> bool:
        return not self.hits(room, "drop")
