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
- One thread per backend owns the UCX worker (all UCX calls happen there, in blocking
  progress mode: it sleeps on the worker's epoll descriptor when idle). Transfer workers
  hand it pushes and wait for them to complete.

Endpoint error handling (``$BATON_UCX_ERROR_HANDLING=1``) is off by default: UCX then may
use transports that cannot report a failed peer (shared memory, CMA, CUDA IPC), which are
the fast ones on one host (loopback here: about 1 GB/s over tcp with it, 4-10 GB/s without).
Either way a lost peer is noticed through the control plane, deadlines, and sends that
stall for ``transferring_s``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import threading
from collections import deque
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

logger = logging.getLogger(__name__)

HEADER_TAG = 0xBA7_0000_0000_0001
_PAYLOAD_BIT = 1 << 63  # payload tags never collide with HEADER_TAG
_HEADER_SLOTS = 16
_BATCH_REGIONS = 256  # regions per header: ~25 KiB of msgpack, under MAX_HEADER_BYTES
_ADDRESS_PREFIX = "ucx:"

Done = Callable[[Exception | None], None]
_Message = tuple[bytes, list[tuple[torch.Tensor, int]]]  # header; payloads and their tags


def _import_ucxx() -> Any:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as ucx_api
    except Exception as exc:  # ImportError, or a broken libucx underneath
        raise RuntimeError(
            f"the ucx transfer backend needs ucxx (pip install ucxx-cu12): {exc}"
        ) from exc
    return ucx_api


def _array(tensor: torch.Tensor) -> Any:
    """What ucxx can send from / receive into: numpy for host memory, CUDA tensors as-is."""
    from ucxx._lib.arr import Array

    return Array(tensor if tensor.is_cuda else tensor.numpy())


class _UcxThread:
    """Owns one UCX context and worker; runs commands and request callbacks in order."""

    def __init__(self, ucx: Any, device: torch.device | None):
        self.ucx = ucx
        self._device = device
        self._commands: deque[Callable[[], None]] = deque()
        self._pending: list[tuple[Any, Done, object]] = []
        self._fresh = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._ready = threading.Event()
        self._error: Exception | None = None
        self.worker: Any = None
        self.address = b""  # the worker's UCX address
        self._thread = threading.Thread(target=self._run, name="kv-ucx", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"ucx backend failed to start: {self._error}") from self._error

    def call(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the UCX thread (soon, in submission order)."""
        self._commands.append(command)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def watch(self, request: Any, done: Done, keep: object = None) -> None:
        """UCX thread only: call ``done(error or None)`` when ``request`` completes; ``keep``
        (the request's buffer) stays referenced until then."""
        self._pending.append((request, done, keep))
        self._fresh = True  # it may have completed already, as it was posted

    def stop(self) -> None:
        self._stopping = True
        self.call(lambda: None)
        self._thread.join(timeout=5)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
                torch.empty(1, device=self._device)  # UCX needs a current CUDA context here
            ucx = self.ucx
            context = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
            self.worker = ucx.UCXWorker(context)
            self.worker.init_blocking_progress_mode()
            self.address = self.worker.address.tobytes()
        except Exception as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        epoll = select.epoll()
        epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        try:
            while not self._stopping:
                self._loop_once(epoll)
        finally:
            epoll.close()
            self._wake_r.close()
            self._pending.clear()
            self._commands.clear()
            self.worker.cancel_inflight_requests()
            self.worker = None

    def _loop_once(self, epoll: select.epoll) -> None:
        acted, self._fresh = self._fresh or bool(self._commands), False
        while self._commands:
            self._guarded(self._commands.popleft())
        for _ in range(64):  # bounded, so commands and completions get their turn
            if not self.worker.progress_once():
                break
            acted = True
        if not acted:  # nothing happened: nothing can have completed
            self._sleep(epoll)
            return
        finished: list[tuple[Any, Done, object]] = []
        pending: list[tuple[Any, Done, object]] = []
        for entry in self._pending:
            (finished if entry[0].completed else pending).append(entry)
        self._pending = pending
        for request, done, _ in finished:
            error: Exception | None = None
            try:
                request.check_error()
            except Exception as exc:
                error = exc
            self._guarded(done, error)

    def _sleep(self, epoll: select.epoll) -> None:
        if self._commands or not self.worker.arm():
            return
        # Armed: UCX will signal its descriptor on any event. Sleep until then, or a command.
        for fd, _ in epoll.poll(0.1 if not self._pending else 0.01):
            if fd == self._wake_r.fileno():
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("kv ucx: callback failed")


class _Receiver:
    """D's side, on the UCX thread: header slots, region checks, payload receives."""

    def __init__(self, engine: _UcxThread, buffer: ByteBuffer, sink: RegionSink):
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
        request = self._engine.worker.tag_recv(_array(target), ucx.UCXXTag(frame.tag))
        self._engine.watch(request, done, keep=target)

    def _on_payload(self, grant: WriteGrant, error: Exception | None) -> None:
        grant.unpin()
        if error is not None:
            logger.warning("kv ucx: payload receive failed: %s", error)
        self._sink.close(grant, error is None)


class UcxConnection(DataConnection):
    """P's endpoint to one D. Pushes run on the UCX thread; the caller waits for them."""

    def __init__(
        self,
        engine: _UcxThread,
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
                    sends += [(_array(payload), tag) for payload, tag in payloads]
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
        self._ucx = _import_ucxx()  # fail at creation, with a clear message
        self._engine: _UcxThread | None = None
        self._timeout_s = 60.0
        if error_handling is None:
            error_handling = UCX_ERROR_HANDLING.get()
        self._error_handling = error_handling

    def start(self, args: KVArgs, sink: RegionSink | None) -> str | None:
        device = args.buffer.device if args.buffer.is_cuda else None
        self._engine = _UcxThread(self._ucx, device)
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
