"""The KV-control plane: ZMQ sockets of one manager, all driven by one thread.

- A ROUTER bound on ``host:port`` receives every peer's messages (msgspec, one frame each).
  Malformed, oversized (ZMQ's MAXMSGSIZE drops the connection) or wrongly tokened messages
  are logged and dropped.
- One DEALER per peer sends to it, connected on first use. A monitor on it reports when an
  established connection drops: that peer is lost.
- ``send`` never blocks. Once the thread has connected a peer's DEALER, any thread sends to
  that peer itself (non-blocking, under one lock: ZMQ sockets need a barrier between
  threads); a final status then leaves with the transfer thread that wrote the pages, not
  one thread hop later. Until then, or while older messages wait, it queues the message and
  wakes the thread through a socket pair, so a peer's messages keep their order.
- Every ``tick_s`` the thread calls ``on_tick`` (the manager checks deadlines there).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from baton.common.transfer.messages import (
    MAX_CONTROL_BYTES,
    ControlMessage,
    decode_control,
    encode_control,
)

logger = logging.getLogger(__name__)

_SEND_LINGER_MS = 500  # a final status queued just before shutdown still goes out


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not host:port")
    return host, int(port)


class ControlPlane:
    def __init__(
        self,
        host: str,
        port: int,
        advertise_host: str,
        token: str,
        on_message: Callable[[ControlMessage], None],
        on_peer_lost: Callable[[str], None],
        on_tick: Callable[[], None],
        on_dropped: Callable[[str], None],
        tick_s: float = 0.05,
    ):
        self._token = token.encode()
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        self._on_tick = on_tick
        self._on_dropped = on_dropped
        self._tick_s = tick_s
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._router.setsockopt(zmq.LINGER, 0)
        # A peer must finish the ZMTP handshake in 10 s, and one that vanished without
        # closing (a half-open connection) is found by TCP keepalives.
        self._router.setsockopt(zmq.HANDSHAKE_IVL, 10_000)
        self._router.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self._router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"{advertise_host}:{port}"
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._outbox: deque[tuple[str, bytes | None]] = deque()
        self._send_lock = threading.Lock()  # the dealers and the outbox
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-control", daemon=True)
        self._thread.start()

    def send(self, peer: str, message: ControlMessage) -> None:
        """Send ``message`` to ``peer`` (its control address), or queue it. Never blocks."""
        payload = encode_control(message)
        with self._send_lock:
            dealer = self._dealers.get(peer)
            if dealer is not None and not self._outbox:
                self._send_now(peer, dealer, payload)
                return
            self._outbox.append((peer, payload))
        self._wake()

    def watch(self, peer: str) -> None:
        """Connect to ``peer`` now, so that losing it is noticed before anything is sent."""
        with self._send_lock:
            self._outbox.append((peer, None))
        self._wake()

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        self._wake_w.close()
        self._wake_r.close()

    def _wake(self) -> None:
        # A full pair means the thread wakes anyway; a closed one, that it is gone.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        next_tick = time.monotonic() + self._tick_s
        try:
            while not self._stopping:
                timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
                ready = dict(poller.poll(int(timeout_ms)))
                if ready.pop(self._wake_r.fileno(), None):
                    self._drain_wake()
                if ready.pop(self._router, None):
                    self._receive_all()
                self._flush_outbox(poller)
                for monitor in ready:
                    if isinstance(monitor, zmq.Socket) and monitor in self._monitors:
                        self._check_monitor(monitor)
                if time.monotonic() >= next_tick:
                    self._guarded(self._on_tick)
                    next_tick = time.monotonic() + self._tick_s
            self._flush_outbox(poller)
        finally:
            self._close_sockets()

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _receive_all(self) -> None:
        while True:
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                self._on_dropped(f"control message of {len(parts)} frames")
                continue
            try:
                message = decode_control(parts[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._on_dropped(f"undecodable control message ({exc})")
                continue
            if not hmac.compare_digest(message.token.encode(), self._token):
                self._on_dropped(f"{type(message).__name__} with a wrong token")
                continue
            self._guarded(self._on_message, message)

    def _flush_outbox(self, poller: zmq.Poller) -> None:
        with self._send_lock:
            while self._outbox:
                peer, payload = self._outbox.popleft()
                dealer = self._dealer(peer, poller)
                if payload is not None:
                    self._send_now(peer, dealer, payload)

    @staticmethod
    def _send_now(peer: str, dealer: zmq.Socket[bytes], payload: bytes) -> None:
        try:
            dealer.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("control message to %s dropped: %s", peer, exc)

    def _dealer(self, peer: str, poller: zmq.Poller) -> zmq.Socket[bytes]:
        """The DEALER to ``peer``, connected on first use (this thread, under the lock)."""
        dealer = self._dealers.get(peer)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
            dealer.setsockopt(zmq.SNDHWM, 100_000)
            monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[monitor] = peer
            poller.register(monitor, zmq.POLLIN)
            dealer.connect(f"tcp://{peer}")
            self._dealers[peer] = dealer
        return dealer

    def _check_monitor(self, monitor: zmq.Socket[bytes]) -> None:
        lost = False
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
        if lost:
            # The peer's last messages may sit in the router unread: they win over the loss.
            self._receive_all()
            self._guarded(self._on_peer_lost, self._monitors[monitor])

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("kv-control callback %s failed", getattr(fn, "__name__", fn))

    def _close_sockets(self) -> None:
        with self._send_lock:  # later sends queue into an outbox nobody flushes
            dealers, self._dealers = self._dealers, {}
        for dealer in dealers.values():
            dealer.disable_monitor()
        for monitor in self._monitors:
            monitor.close(linger=0)
        for dealer in dealers.values():
            dealer.close()
        self._router.close(linger=0)
        self._ctx.term()
