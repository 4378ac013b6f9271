"""The `ucx` backend: UCX tag messages through ucxx (TCP, shared memory, CUDA IPC, RDMA).

UCX picks the transport: on one host, host memory moves through shared memory or CMA and
CUDA memory through CUDA IPC (NVLink); across hosts through RDMA or TCP. The same code
serves CPU and CUDA buffers: payloads are sent from, and received into, slices of the KV
tensors themselves.

- Transfer address: ``"ucx:" + hex(worker address)``. D's address travels to P inside the
  authenticated init message; D opens no listening port of its own (a ucxx listener would
  bind every interface).
- Every header frame (length-prefixed msgpack, as on tcp) goes to ``HEADER_TAG``. D keeps
  ``_HEADER_SLOTS`` receives of ``MAX_HEADER_BYTES`` posted for them; a larger message is
  truncated by UCX and dropped, garbage is dropped.
- A connection starts with a ``DataHello`` carrying a random connection id. Then each push
  is one ``RegionBatch`` header (that id, and per region its place and its payload's tag)
  followed by one tagged payload message per region. D checks each region
  (``RegionSink.open``) and only then posts a receive for its payload straight into the
  room's pages; payloads of dropped regions are consumed into scratch. One header per batch
  keeps the per-region cost (Python, on both sides) to a few calls.
- One thread per backend owns the UCX worker (`ucx_thread.UcxThread`): all UCX calls
  happen there, in blocking progress mode, and it sleeps on the worker's epoll descriptor
  when idle. Transfer workers hand it pushes and wait for them to complete.

Endpoint error handling (``$BATON_UCX_ERROR_HANDLING=1``) is off by default: UCX then may
use transports that cannot report a failed peer (shared memory, CMA, CUDA IPC), which are
the fast ones on one host (loopback here: about 1 GB/s over tcp with it, 4-10 GB/s without).
Either way a lost peer is noticed through the control plane, deadlines, and sends that
stall for ``transferring_s``.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from baton.common.env import UCX_ERROR_HANDLING
from baton.common.transfer.backend import (
    DataConnection,
    Outbound,
    ProtocolViolation,
    RegionSink,
    TransferBackend,
    WriteGrant,
)
from baton.common.transfer.base import KVArgs, PeerLostError, TransferError
from baton.common.transfer.messages import (
    MAX_HEADER_BYTES,
    DataFrame,
    DataHello,
    RegionBatch,
    RegionFrame,
    decode_prefixed_frame,
    encode_frame,
)
from baton.common.transfer.regions import ByteBuffer
from baton.common.transfer.ucx_thread import Done, UcxThread, import_ucxx, ucx_array

logger = logging.getLogger(__name__)

HEADER_TAG = 0xBA7_0000_0000_0001
_PAYLOAD_BIT = 1 << 63  # payload tags never collide with HEADER_TAG
_HEADER_SLOTS = 16
_BATCH_REGIONS = 256  # regions per header: ~25 KiB of msgpack, under MAX_HEADER_BYTES
_ADDRESS_PREFIX = "ucx:"

_Message = tuple[bytes, list[tuple[torch.Tensor, int]]]  # header; payloads and their tags


class _Receiver:
    """D's side, on the UCX thread: header slots, region checks, payload receives."""

    def __init__(self, engine: UcxThread, buffer: ByteBuffer, sink: RegionSink):
        self._engine = engine
        self._buffer = buffer
        self._sink = sink
        self._peers: dict[int, str] = {}  # connection id -> sender, from its hello
        self._scratch = torch.empty(64, dtype=torch.uint8)
        for _ in range(_HEADER_SLOTS):
            engine.call(lambda: self._post_header(np.empty(MAX_HEADER_BYTES, np.uint8)))

    def _post_header(self, slot: np.ndarray) -> None:
        from ucxx._lib.arr import Array

        ucx = self._engine.ucx
        request = self._engine.worker.tag_recv(Array(slot), ucx.UCXXTag(HEADER_TAG))
        self._engine.watch(request, lambda error: self._on_header(slot, error))

    def _on_header(self, slot: np.ndarray, error: Exception | None) -> None:
        try:
            if error is not None:
                self._sink.dropped(f"ucx header ({error})")
            else:
                self._handle(decode_prefixed_frame(slot.data))
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._sink.dropped(f"ucx header: {exc}")
        finally:
            if self._engine.worker is not None:
                self._post_header(slot)

    def _handle(self, frame: DataFrame) -> None:
        if isinstance(frame, DataHello):
            if self._sink.hello(frame):
                self._peers[frame.conn] = frame.peer
            return
        if not isinstance(frame, RegionBatch):
            self._sink.dropped(f"ucx {type(frame).__name__} outside a batch")
            return
        peer = self._peers.get(frame.conn)
        if peer is None:  # unauthenticated: nothing of it is received or consumed
            self._sink.dropped(f"ucx regions from unknown connection {frame.conn}")
            return
        for region in frame.regions:
            self._region(region, peer, frame.conn)

    def _region(self, frame: RegionFrame, peer: str, conn: int) -> None:
        grant: WriteGrant | None = None
        if conn in self._peers:
            try:
                grant = self._sink.open(frame, peer)
            except ProtocolViolation as exc:
                self._sink.dropped(f"ucx region from {peer}: {exc}")
                del self._peers[conn]  # later batches of this connection are ignored
        if grant is not None and grant.pin():
            target = self._buffer.slice(grant.offset, grant.length)
            self._receive(frame, target, lambda error: self._on_payload(grant, error))
            return
        if grant is not None:
            self._sink.close(grant, False)
        # Consume the payload so it does not sit in UCX's queue: a receive smaller than the
        # message ends "truncated" and drops it, whatever its size.
        self._receive(frame, self._scratch, lambda error: None)

    def _receive(self, frame: RegionFrame, target: torch.Tensor, done: Done) -> None:
        ucx = self._engine.ucx
        request = self._engine.worker.tag_recv(ucx_array(target), ucx.UCXXTag(frame.tag))
        self._engine.watch(request, done, keep=target)

    def _on_payload(self, grant: WriteGrant, error: Exception | None) -> None:
        grant.unpin()
        if error is not None:
            logger.warning("kv ucx: payload receive failed: %s", error)
        self._sink.close(grant, error is None)


class UcxConnection(DataConnection):
    """P's endpoint to one D. Pushes run on the UCX thread; the caller waits for them."""

    backend = "ucx"

    def __init__(
        self,
        engine: UcxThread,
        address: str,
        hello: DataHello,
        timeout_s: float,
        error_handling: bool,
    ):
        if not address.startswith(_ADDRESS_PREFIX):
            raise TransferError(f"not a ucx transfer address: {address[:40]!r}")
        self._engine = engine
        self._timeout_s = timeout_s
        self._conn = secrets.randbits(31) | 1
        self._seq = 0
        self._endpoint: Any = None
        try:
            raw = np.frombuffer(bytes.fromhex(address[len(_ADDRESS_PREFIX) :]), np.uint8)
        except ValueError:
            raise TransferError(f"malformed ucx transfer address {address[:40]!r}") from None

        def create() -> None:
            ucx = engine.ucx
            remote = ucx.UCXAddress.create_from_buffer(raw)
            self._endpoint = ucx.UCXEndpoint.create_from_worker_address(
                engine.worker, remote, error_handling
            )

        hello = msgspec.structs.replace(hello, conn=self._conn)
        self._run(create, [(encode_frame(hello), [])])

    def push(self, source: ByteBuffer, items: Sequence[Outbound]) -> None:
        messages: list[_Message] = []
        for start in range(0, len(items), _BATCH_REGIONS):
            frames, payloads = [], []
            for item in items[start : start + _BATCH_REGIONS]:
                self._seq = (self._seq + 1) & 0xFFFF_FFFF
                tag = _PAYLOAD_BIT | (self._conn << 32) | self._seq
                frames.append(msgspec.structs.replace(item.frame, tag=tag))
                payloads.append((source.slice(item.src_offset, item.frame.length), tag))
            messages.append((encode_frame(RegionBatch(self._conn, frames)), payloads))
        self._run(None, messages)

    def _run(self, setup: Callable[[], None] | None, messages: list[_Message]) -> None:
        """On the UCX thread: run ``setup``, then send each header and payload; wait."""
        finished = threading.Event()
        errors: list[Exception] = []
        left = 0

        def one_done(error: Exception | None) -> None:
            nonlocal left
            if error is not None:
                errors.append(error)
            left -= 1
            if left == 0:
                finished.set()

        def start() -> None:
            nonlocal left
            ucx = self._engine.ucx
            try:
                if setup is not None:
                    setup()
                for header, payloads in messages:
                    sends = [(_bytes(header), HEADER_TAG)]
                    sends += [(ucx_array(payload), tag) for payload, tag in payloads]
                    for array, value in sends:
                        request = self._endpoint.tag_send(array, ucx.UCXXTag(value))
                        left += 1
                        self._engine.watch(request, one_done, keep=array)
            except Exception as exc:
                errors.append(exc)
            if left == 0:
                finished.set()

        self._engine.call(start)
        if not finished.wait(self._timeout_s):
            raise PeerLostError(f"ucx send stalled for {self._timeout_s:.0f} s")
        if errors:
            raise PeerLostError(f"ucx send failed: {errors[0]}")

    def close(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            self._engine.call(endpoint.close)


def _bytes(data: bytes) -> Any:
    from ucxx._lib.arr import Array

    return Array(np.frombuffer(data, np.uint8))


class UcxBackend(TransferBackend):
    name = "ucx"

    def __init__(self, error_handling: bool | None = None) -> None:
        self._ucx = import_ucxx()  # fail at creation, with a clear message
        self._engine: UcxThread | None = None
        self._timeout_s = 60.0
        if error_handling is None:
            error_handling = UCX_ERROR_HANDLING.get()
        self._error_handling = error_handling

    def start(self, args: KVArgs, sink: RegionSink | None) -> str | None:
        device = args.buffer.device if args.buffer.is_cuda else None
        self._engine = UcxThread(self._ucx, device)
        self._timeout_s = args.deadlines.transferring_s
        if sink is None:
            return None
        _Receiver(self._engine, ByteBuffer(args.buffer), sink)
        return _ADDRESS_PREFIX + self._engine.address.hex()

    def connect(self, address: str, hello: DataHello) -> DataConnection:
        assert self._engine is not None, "start() first"
        return UcxConnection(self._engine, address, hello, self._timeout_s, self._error_handling)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
