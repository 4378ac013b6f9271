"""The `fake` backend, for tests: moves data exactly like `tcp`, and applies a fault plan.

The plan is a string, from ``KVArgs.fault_plan`` or else ``$BATON_FAKE_TRANSFER``; only the
sending side applies it. Grammar (whitespace ignored, an empty plan injects nothing)::

    plan  := fault (";" fault)*
    fault := kind [":" param ("," param)*]
    param := name "=" integer

    fail:every=N     every Nth room fails on the sender with "fake fault: fail" (D is told)
    drop:every=N     every Nth room's final status is silently never sent: P reports
                     Success, D waits until its deadline
    delay:ms=M       sleep M ms before each push of regions and before each final status
    corrupt:every=N  every Nth room's payload bytes are flipped on the wire (the source stays
                     intact): a receiver with verify_checksum fails it, "checksum mismatch"

``every`` defaults to 1. Rooms are numbered 1, 2, … in the order they first reach the
backend (their first push, or their final status when there is nothing to push), so
``fail:every=2`` fails the 2nd, 4th, … room. Example: ``"fail:every=3; delay:ms=50"``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from baton.common.transfer.backend import DataConnection, Outbound, RegionSink
from baton.common.transfer.base import KVArgs, PeerLostError, TransferError
from baton.common.transfer.messages import DataHello, encode_frame
from baton.common.transfer.regions import ByteBuffer
from baton.common.transfer.tcp import TcpBackend, TcpConnection, send_buffers

ENV_VAR = "BATON_FAKE_TRANSFER"
_KINDS = {"fail": "every", "drop": "every", "delay": "ms", "corrupt": "every"}


@dataclass(frozen=True)
class FaultPlan:
    fail_every: int = 0  # 0: never
    drop_every: int = 0
    corrupt_every: int = 0
    delay_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        fields: dict[str, int] = {}
        for fault in filter(None, (part.strip() for part in text.split(";"))):
            kind, _, params = (s.strip() for s in fault.partition(":"))
            if kind not in _KINDS:
                raise ValueError(f"fault plan {text!r}: unknown fault {kind!r}")
            values = {_KINDS[kind]: 1} if kind != "delay" else {}
            for param in filter(None, (p.strip() for p in params.split(","))):
                name, eq, value = (s.strip() for s in param.partition("="))
                if name != _KINDS[kind] or not eq or not value.isdigit():
                    raise ValueError(f"fault plan {text!r}: bad parameter {param!r} of {kind}")
                values[name] = int(value)
            if _KINDS[kind] not in values:
                raise ValueError(f"fault plan {text!r}: {kind} needs {_KINDS[kind]}=")
            fields[f"{kind}_{_KINDS[kind]}"] = values[_KINDS[kind]]
        return cls(**fields)


class FakeConnection(TcpConnection):
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
            text = args.fault_plan if args.fault_plan is not None else os.environ.get(ENV_VAR, "")
            self.plan = FaultPlan.parse(text)
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
