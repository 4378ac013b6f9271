"""The `tcp` backend: plain sockets, always available.

Wire format of a connection (sender -> receiver only)::

    [u32 length][msgpack DataHello]  then, per region,  [u32 length][msgpack RegionFrame][payload]

The receiver runs one selector thread over all connections with non-blocking sockets. A
payload is read with ``recv_into`` straight into the destination slice of the KV buffer
(host memory; a CUDA buffer goes through a pinned staging buffer). Each read takes only what
the kernel already holds, under the room's write lock, so a release never waits on the
network. A stream that breaks the rules is closed; the listener goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Sequence

import msgspec
import torch

from baton.common.transfer.backend import (
    DataConnection,
    Outbound,
    ProtocolViolation,
    RegionSink,
    TransferBackend,
    WriteGrant,
)
from baton.common.transfer.base import KVArgs, PeerLostError
from baton.common.transfer.control import split_address
from baton.common.transfer.messages import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    DataHello,
    RegionFrame,
    decode_frame,
    encode_frame,
    frame_length,
)
from baton.common.transfer.regions import ByteBuffer

logger = logging.getLogger(__name__)

_STAGING_BYTES = 8 << 20  # host staging for CUDA buffers
_READS_PER_WAKEUP = 64  # then let the other connections have a turn


def _staging(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Write every byte of ``buffers`` (one syscall each time the kernel takes them)."""
    while buffers:
        sent = sock.sendmsg(buffers)
        while sent:
            if sent >= len(buffers[0]):
                sent -= len(buffers.pop(0))
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0


HELLO_TIMEOUT_S = 10.0  # an accepted connection must say hello within this


def _keepalive(sock: socket.socket) -> None:
    """Find a peer that vanished without closing (a half-open connection) in about a
    minute instead of never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux names
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class TcpConnection(DataConnection):
    backend = "tcp"

    def __init__(self, address: str, hello: DataHello, stall_timeout_s: float):
        host, port = split_address(address)
        try:
            self.sock = socket.create_connection((host, port), timeout=stall_timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_buffers(self.sock, [memoryview(encode_frame(hello))])
        except OSError as exc:
            raise PeerLostError(f"connect to {address}: {exc}") from exc
        self._address = address
        self._staging: torch.Tensor | None = None

    def push(self, source: ByteBuffer, items: Sequence[Outbound]) -> None:
        try:
            for item in items:
                header = memoryview(encode_frame(item.frame))
                payload = source.host(item.src_offset, item.frame.length)
                if payload is not None:
                    send_buffers(self.sock, [header, payload])
                else:
                    send_buffers(self.sock, [header])
                    self._send_device(source, item.src_offset, item.frame.length)
        except OSError as exc:  # includes timeouts: a peer that stopped reading
            raise PeerLostError(f"send to {self._address}: {exc}") from exc

    def _send_device(self, source: ByteBuffer, offset: int, length: int) -> None:
        if self._staging is None:
            self._staging = _staging(_STAGING_BYTES)
        host = self._staging.numpy().data
        for start in range(0, length, _STAGING_BYTES):
            size = min(_STAGING_BYTES, length - start)
            self._staging[:size].copy_(source.slice(offset + start, size))
            send_buffers(self.sock, [host[:size]])

    def close(self) -> None:
        self.sock.close()


class _Inbound:
    """Reading state of one accepted connection."""

    def __init__(self, sock: socket.socket, listener: TcpListener):
        self.sock = sock
        self._listener = listener
        self._sink = listener.sink
        self._header = bytearray(MAX_HEADER_BYTES)
        self._need = PREFIX_BYTES  # header bytes wanted (prefix, then body)
        self._got = 0
        self._in_body = False
        self.peer: str | None = None
        self.grant: WriteGrant | None = None
        self.opened = time.monotonic()
        self._pos = 0  # payload bytes already read
        self._length = 0  # payload bytes of the current region (0: reading a header)

    def on_readable(self) -> bool:
        """Read what is there; False when the connection must close."""
        for _ in range(_READS_PER_WAKEUP):
            try:
                n = self._read_payload() if self._length else self._read_header()
            except BlockingIOError:
                return True
            except (ConnectionError, OSError):
                return False
            if n == 0:
                return False
        return True

    def _read_header(self) -> int:
        n = self.sock.recv_into(memoryview(self._header)[self._got : self._need])
        self._got += n
        if n and self._got == self._need:
            if self._in_body:
                self._on_header(bytes(self._header[: self._need]))
                self._need, self._got, self._in_body = PREFIX_BYTES, 0, False
            else:
                self._need, self._got, self._in_body = frame_length(self._header[:4]), 0, True
        return n

    def _on_header(self, body: bytes) -> None:
        frame = decode_frame(body)
        if self.peer is None:
            if not isinstance(frame, DataHello) or not self._sink.hello(frame):
                raise ProtocolViolation("the first frame must be a valid hello")
            self.peer = frame.peer
            return
        if not isinstance(frame, RegionFrame):
            raise ProtocolViolation(f"unexpected {type(frame).__name__} frame")
        self.grant = self._sink.open(frame, self.peer)
        self._length, self._pos = frame.length, 0

    def _read_payload(self) -> int:
        grant, remaining = self.grant, self._length - self._pos
        listener = self._listener
        if grant is None:  # drop: read into scratch
            n = self.sock.recv_into(listener.scratch, min(remaining, len(listener.scratch)))
        elif listener.buffer.is_cuda:
            n = self._read_staged(grant, remaining)
        else:
            with grant.hold() as accepting:
                if accepting:
                    view = listener.buffer.host(grant.offset + self._pos, remaining)
                    assert view is not None
                    n = self.sock.recv_into(view)
                else:
                    n = self.sock.recv_into(listener.scratch, min(remaining, len(listener.scratch)))
                    self._abandon()
        self._pos += n
        if n and self._pos == self._length:
            if self.grant is not None:
                self._sink.close(self.grant, True)
            self.grant, self._length = None, 0
        return n

    def _read_staged(self, grant: WriteGrant, remaining: int) -> int:
        """CUDA destination: fill a staging chunk, then copy it to the device under hold."""
        listener = self._listener
        chunk_start = self._pos - self._pos % _STAGING_BYTES
        chunk_end = min(chunk_start + _STAGING_BYTES, self._length)
        staging = listener.staging_view()
        n = self.sock.recv_into(staging[self._pos - chunk_start : chunk_end - chunk_start])
        if n and self._pos + n == chunk_end:
            with grant.hold() as accepting:
                if accepting:
                    size = chunk_end - chunk_start
                    target = listener.buffer.slice(grant.offset + chunk_start, size)
                    target.copy_(listener.staging_tensor()[:size])
                else:
                    self._abandon()
        return n

    def _abandon(self) -> None:
        """The room stopped accepting mid-region: read the rest into scratch."""
        if self.grant is not None:
            self._sink.close(self.grant, False)
            self.grant = None

    def close(self, peer_lost: bool) -> None:
        if self.grant is not None:
            self._sink.close(self.grant, False)
            self.grant = None
        self.sock.close()
        if peer_lost and self.peer is not None:
            self._sink.peer_lost(self.peer)


class TcpListener:
    """The receiving side: accepts connections and reads them on one selector thread."""

    def __init__(self, host: str, advertise_host: str, buffer: ByteBuffer, sink: RegionSink):
        self.buffer = buffer
        self.sink = sink
        self.scratch = bytearray(1 << 20)
        self._staging: torch.Tensor | None = None
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((host, 0))
        self._server.listen(128)
        self._server.setblocking(False)
        self.address = f"{advertise_host}:{self._server.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False
        self._next_sweep = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-tcp-recv", daemon=True)
        self._thread.start()

    def staging_tensor(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = _staging(_STAGING_BYTES)
        return self._staging

    def staging_view(self) -> memoryview:
        return self.staging_tensor().numpy().data

    def close(self) -> None:
        self._stopping = True
        # (the thread may have seen `_stopping` between selects and closed its end already)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=5)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(timeout=1.0):
                    if key.fileobj is self._server:
                        self._accept()
                    elif isinstance(key.data, _Inbound):
                        self._serve(key.data)
                self._close_silent()
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, _Inbound):
                    key.data.close(peer_lost=False)
            self._selector.close()
            self._server.close()
            self._wake_r.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors, say: keep serving the others
                logger.warning("kv tcp receiver: accept failed: %s", exc)
                return
            sock.setblocking(False)
            _keepalive(sock)
            self._selector.register(sock, selectors.EVENT_READ, _Inbound(sock, self))

    def _close_silent(self) -> None:
        """Connections that did not say hello in time hold a socket for nothing: close."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        horizon = now - HELLO_TIMEOUT_S
        for key in list(self._selector.get_map().values()):
            conn = key.data
            if isinstance(conn, _Inbound) and conn.peer is None and conn.opened < horizon:
                self.sink.dropped("a connection that sent no hello in time")
                self._selector.unregister(conn.sock)
                conn.close(peer_lost=False)

    def _serve(self, conn: _Inbound) -> None:
        try:
            open_ = conn.on_readable()
        except (ProtocolViolation, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.sink.dropped(f"connection from {conn.peer or 'an unknown peer'}: {exc}")
            open_ = False
        except Exception:
            logger.exception("kv tcp receiver: connection from %s failed", conn.peer)
            open_ = False
        if not open_:
            self._selector.unregister(conn.sock)
            conn.close(peer_lost=True)


class TcpBackend(TransferBackend):
    name = "tcp"

    def __init__(self) -> None:
        self._listener: TcpListener | None = None
        self._stall_timeout_s = 60.0

    def start(self, args: KVArgs, sink: RegionSink | None) -> str | None:
        self._stall_timeout_s = args.deadlines.transferring_s
        if sink is None:
            return None
        advertise = args.advertise_host or args.host
        self._listener = TcpListener(args.host, advertise, ByteBuffer(args.buffer), sink)
        return self._listener.address

    def connect(self, address: str, hello: DataHello) -> DataConnection:
        return TcpConnection(address, hello, self._stall_timeout_s)

    def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
