"""The KV manager of one worker: rooms, control plane, data plane and transfer workers.

Threads it owns: ``kv-control`` (ZMQ sockets, control messages, deadline sweep every
50 ms), the backend's receiving thread(s) on a decode worker, and the transfer workers on a
prefill worker (on a decode worker too once it sends a live migration's pages). The scheduler's thread only calls the non-blocking methods of the manager,
its senders and its receivers.

Messages for a room this side has not created yet (an init that beats ``create_sender``,
an abort that beats ``create_receiver``) are kept for the bootstrap deadline and applied
when the room is created.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, TypeAlias

from baton.common.ratelog import RateLimitedLog
from baton.common.transfer.backend import TransferBackend
from baton.common.transfer.base import KVArgs, KVManager, KVPoll, Role
from baton.common.transfer.control import ControlPlane, split_address
from baton.common.transfer.messages import (
    ControlMessage,
    DataHello,
    KVAbort,
    KVDone,
    KVHeld,
    KVInit,
    KVLanded,
    KVReleased,
    RoomMessage,
)
from baton.common.transfer.receiver import InboundRegions, ReceiverRoom
from baton.common.transfer.regions import ByteBuffer
from baton.common.transfer.registry import make_backend
from baton.common.transfer.room import RoomServices, TransferStats
from baton.common.transfer.sender import SenderRoom
from baton.common.transfer.workers import TransferWorkers

logger = logging.getLogger(__name__)
_dropped_log = RateLimitedLog(logger)  # junk frames are counted (frames_dropped)

_MAX_EARLY = 65_536  # rooms with a message waiting for their create_*()
HELD_INTERVAL_S = 1.0  # how often each peer hears which rooms this side still holds

Room: TypeAlias = SenderRoom | ReceiverRoom


class TransferManager(KVManager):
    """``TransferManager(args, "prefill" | "decode", backend)``; backend by name or object."""

    def __init__(self, args: KVArgs, role: Role, backend: TransferBackend | str):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        self.role = role
        self._args = args
        self._backend = make_backend(backend) if isinstance(backend, str) else backend
        self._stats = TransferStats()
        self._lock = threading.Lock()
        self._rooms: dict[int, Room] = {}
        self._early: dict[int, tuple[float, list[RoomMessage]]] = {}
        self._closed = False
        self._last_held = 0.0
        d = args.deadlines
        self._held_interval = min(HELD_INTERVAL_S, d.bootstrap_s / 3, d.waiting_s / 3)
        self._buffer = ByteBuffer(args.buffer)
        self._control = ControlPlane(
            args.host,
            args.control_port,
            args.advertise_host or args.host,
            args.token,
            on_message=self._on_message,
            on_peer_lost=self._on_peer_lost,
            on_tick=self._sweep,
            on_dropped=self._dropped,
        )
        self._services = RoomServices(
            token=args.token,
            page_bytes=args.page_bytes,
            num_pages=args.num_pages,
            checksum=args.verify_checksum,
            deadlines=args.deadlines,
            stats=self._stats,
            send_control=self._control.send,
            forget=self._forget,
            buffer=self._buffer,
        )
        self._workers: TransferWorkers | None = None
        try:
            if role == "decode":
                sink = InboundRegions(
                    self._lookup_receiver, self._buffer, self._services, self._on_peer_lost
                )
                self._transfer_address = self._backend.start(args, sink)
            else:
                self._transfer_address = self._backend.start(args, None)
                self._workers = self._start_workers()
        except BaseException:
            self._control.close()
            raise

    def _start_workers(self) -> TransferWorkers:
        hello = DataHello(token=self._args.token, peer=self._control.address)
        return TransferWorkers(
            self._backend,
            self._buffer,
            self._args.page_bytes,
            hello,
            self._args.transfer_threads,
            self._stats,
            self._on_peer_lost,
        )

    # ---- KVManager ----
    @property
    def control_address(self) -> str:
        return self._control.address

    @property
    def transfer_address(self) -> str | None:
        return self._transfer_address if self.role == "decode" else None

    def create_receiver(self, room: int, peer_control_address: str) -> ReceiverRoom:
        self._check_create("decode", peer_control_address)
        address = self._transfer_address
        assert address is not None
        backend = self._backend
        receiver = ReceiverRoom(
            room, peer_control_address, self._services, address, backend.accepts_direct,
            backend.doorbells,
        )  # fmt: skip
        self._add(receiver)
        self._control.watch(peer_control_address)
        return receiver

    def create_sender(self, room: int, peer_control_address: str) -> SenderRoom:
        """On a prefill manager, and on a decode manager for a live migration (the pages
        of a running request to another decode worker: its transfer workers start then)."""
        if self.role == "decode" and self._workers is None and not self._closed:
            self._workers = self._start_workers()
        self._check_create(self.role, peer_control_address)
        workers = self._workers
        assert workers is not None
        sender = SenderRoom(room, peer_control_address, self._services, workers.submit)
        self._add(sender)
        self._control.watch(peer_control_address)
        return sender

    def connect(self, transfer_address: str) -> Future[None]:
        """Open the data connections to the receiver at `transfer_address` now, without
        waiting (a live migration's target, known before its hand-off): the first room
        there then waits for no handshake. Done once they are open, or with why not."""
        if self._closed:
            raise RuntimeError("the transfer manager is shut down")
        if self.role == "decode" and self._workers is None:
            self._workers = self._start_workers()
        assert self._workers is not None
        return self._workers.connect(transfer_address)

    def fail_peer(self, control_address: str, reason: str = "peer lost") -> int:
        with self._lock:
            rooms = [r for r in self._rooms.values() if r.state.peer == control_address]
        failed = 0
        for room in rooms:
            if isinstance(room, ReceiverRoom):
                room.on_released()  # a lost peer writes nothing more
            if not room.state.state.terminal:
                room.fail(reason, tell_peer=False)
                failed += room.state.state == KVPoll.Failed
        if failed:
            logger.warning("kv: %d rooms with %s failed: %s", failed, control_address, reason)
        return failed

    def stats(self) -> dict[str, Any]:
        out = self._stats.snapshot()
        with self._lock:
            out["rooms_active"] = sum(not r.state.state.terminal for r in self._rooms.values())
        out.update(self._backend.stats())
        out["role"] = self.role
        out["backend"] = self._backend.name
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            rooms = list(self._rooms.values())
        for room in rooms:
            room.fail("shutdown", tell_peer=True)
        if self._workers is not None:
            self._workers.close()
        self._backend.shutdown()
        self._control.close()

    # ---- internals ----
    def _check_create(self, role: Role, peer: str) -> None:
        if self.role != role:
            raise RuntimeError(f"a {self.role} manager cannot do that ({role} only)")
        if self._closed:
            raise RuntimeError("the transfer manager is shut down")
        split_address(peer)

    def _add(self, room: Room) -> None:
        with self._lock:
            if room.room in self._rooms:
                raise ValueError(f"room {room.room} exists")
            self._rooms[room.room] = room
            early = self._early.pop(room.room, None)
        for message in early[1] if early else ():
            self._apply(room, message)

    def _forget(self, room_id: int) -> None:
        with self._lock:
            self._rooms.pop(room_id, None)

    def _lookup_receiver(self, room_id: int) -> ReceiverRoom | None:
        room = self._rooms.get(room_id)
        return room if isinstance(room, ReceiverRoom) else None

    def _on_message(self, message: ControlMessage) -> None:
        if isinstance(message, KVHeld):
            self._on_held(message)
            return
        with self._lock:
            room = self._rooms.get(message.room)
            if room is None:
                if not isinstance(message, KVLanded):  # else: a room the bell let go
                    self._keep_early(message)
                return
        self._apply(room, message)

    def _keep_early(self, message: RoomMessage) -> None:
        """Under self._lock: hold a message until its room is created or the deadline."""
        entry = self._early.get(message.room)
        if entry is None:
            if len(self._early) >= _MAX_EARLY:
                self._dropped(f"message for room {message.room}: too many unknown rooms")
                return
            entry = self._early[message.room] = (time.monotonic(), [])
        if len(entry[1]) < 4:
            entry[1].append(message)

    def _on_held(self, message: KVHeld) -> None:
        with self._lock:
            rooms = [self._rooms.get(room_id) for room_id in message.rooms]
        for room in rooms:
            if room is not None and room.state.peer == message.peer:
                room.state.confirm()

    def _send_held(self) -> None:
        """Tell each peer which rooms with it this side still holds (see KVHeld)."""
        by_peer: dict[str, list[int]] = {}
        with self._lock:
            for room in self._rooms.values():
                if not room.state.state.terminal:
                    by_peer.setdefault(room.state.peer, []).append(room.room)
        for peer, room_ids in by_peer.items():
            self._control.send(peer, KVHeld(self._args.token, self.control_address, room_ids))

    def _apply(self, room: Room, message: RoomMessage) -> None:
        if isinstance(message, KVReleased):
            if isinstance(room, ReceiverRoom):
                room.on_released()
        elif isinstance(message, KVAbort):
            room.fail(f"aborted by peer: {message.reason}", tell_peer=False)
        elif isinstance(message, KVInit) and isinstance(room, SenderRoom):
            room.bootstrap(message)
        elif isinstance(message, KVDone) and isinstance(room, ReceiverRoom):
            room.on_done(message)
        elif isinstance(message, KVLanded) and isinstance(room, ReceiverRoom):
            room.on_landed()
        else:
            self._dropped(f"{type(message).__name__} for room {message.room} on a {self.role}")

    def _on_peer_lost(self, peer: str) -> None:
        self.fail_peer(peer, "peer lost")

    def _sweep(self) -> None:
        """Deadlines of live rooms and of messages for rooms never created; keepalives."""
        now = time.monotonic()
        if now - self._last_held >= self._held_interval:
            self._last_held = now
            self._send_held()
        with self._lock:
            rooms = list(self._rooms.values())
            horizon = time.monotonic() - self._args.deadlines.bootstrap_s
            for room_id in [r for r, (t, _) in self._early.items() if t < horizon]:
                del self._early[room_id]
        for room in rooms:
            room.check_deadline()

    def _dropped(self, what: str) -> None:
        self._stats.add(frames_dropped=1)
        _dropped_log.warning("kv control: dropped %s", what)
