"""D's side: the receiver of one room, and the gate every incoming region passes.

A room accepts writes only between init() and its terminal state, only from the sender it
is bound to (the control address in the connection's hello), and only into the pages it
asked for, each page once. ``InboundRegions`` is the ``RegionSink`` the backend calls: it
bounds-checks a header against the whole buffer, then the room checks it against its pages.

A room succeeds when P's final status has arrived *and* every requested page is written: the
status travels on the control plane and may overtake the last bytes on the data plane.

Release and late writes: once ``release()`` returns, no byte lands in the room's pages
through this side's checks. A write into host memory happens under the room's write lock,
one non-blocking socket read at a time, so release waits at most for one such copy. A write
posted to a transport (ucx) is pinned; release waits up to ``RELEASE_WAIT_S`` for pinned
writes to finish.

Direct writes (ipc) pass no check here: P copies into D's memory itself and says so in the
final status. Where D offers doorbells (see doorbell), that status may come before the
writes landed (``KVDone.landed`` False); the room then succeeds once ``poll`` sees its bell
rung, or ``KVLanded`` arrives. After a room fails, its pages are ``reusable`` only once P
has released it (``KVReleased``: its transfer worker is done with the room), P is lost, or
``DIRECT_RELEASE_GRACE_S`` passed; until then D keeps them out of use.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from baton.common.ratelog import RateLimitedLog
from baton.common.transfer.backend import ProtocolViolation, WriteGrant
from baton.common.transfer.base import KVPoll, KVReceiver
from baton.common.transfer.doorbell import Doorbells
from baton.common.transfer.messages import DataHello, KVAbort, KVDone, KVInit, RegionFrame
from baton.common.transfer.regions import ByteBuffer
from baton.common.transfer.room import RoomServices, RoomState

logger = logging.getLogger(__name__)
_dropped_log = RateLimitedLog(logger)  # junk frames are counted (frames_dropped)

RELEASE_WAIT_S = 1.0
DIRECT_RELEASE_GRACE_S = 5.0


class Grant:
    """A checked permission to write ``length`` bytes at ``offset`` of one room's pages."""

    def __init__(self, room: ReceiverRoom, frame: RegionFrame, pages: int):
        self.room = room
        self.offset = frame.dst_offset
        self.length = frame.length
        self.crc = frame.crc
        self.pages = pages

    @contextmanager
    def hold(self) -> Iterator[bool]:
        with self.room.write_lock:
            yield self.room.accepting

    def pin(self) -> bool:
        return self.room.pin()

    def unpin(self) -> None:
        self.room.unpin()


class ReceiverRoom(KVReceiver):
    def __init__(
        self,
        room: int,
        peer: str,
        services: RoomServices,
        transfer_address: str,
        accepts_direct: bool = False,
        doorbells: Doorbells | None = None,
    ):
        self.room = room
        self.state = RoomState(room, peer, services.deadlines)
        self._svc = services
        self._transfer_address = transfer_address
        self._lock = threading.Lock()  # page bookkeeping
        self.write_lock = threading.RLock()  # held while bytes land in this room's pages
        self.accepting = False  # changes only under write_lock
        self._inflight = 0  # pinned transport writes
        self._idle = threading.Condition(self.write_lock)
        self._page_index: dict[int, int] = {}
        self._claimed = bytearray()
        self._written = 0
        self._regions = 0
        self._done: KVDone | None = None
        self._released = False
        self._accepts_direct = accepts_direct
        self._initialized = False
        self._peer_released = False  # P will write nothing more (KVReleased, or P lost)
        self._failed_at: float | None = None
        self._doorbells = doorbells
        self._bell = -1
        self._landed = False  # P said (or its bell rang) that an early status's writes landed

    # ---- KVReceiver ----
    def init(self, dst_page_ids: Sequence[int], prefix_pages: int = 0) -> None:
        svc = self._svc
        if self.state.state != KVPoll.Bootstrapping:
            raise RuntimeError(f"room {self.room}: init() in state {self.state.state.name}")
        pages = [int(p) for p in dst_page_ids]
        if prefix_pages < 0:
            raise ValueError("prefix_pages must be >= 0")
        if any(not 0 <= p < svc.num_pages for p in pages) or len(set(pages)) != len(pages):
            raise ValueError(f"room {self.room}: destination pages out of range or repeated")
        with self.write_lock:
            self._page_index = {page: i for i, page in enumerate(pages)}
            self._claimed = bytearray(len(pages))
            self.accepting = True
        if self._doorbells is not None:
            self._bell = self._doorbells.allocate()
        message = KVInit(
            room=self.room,
            token=svc.token,
            transfer_address=self._transfer_address,
            dst_page_ids=pages,
            prefix_pages=prefix_pages,
            page_bytes=svc.page_bytes,
            checksum=svc.checksum,
            bell=self._bell,
            traceparent=self.trace_context,
        )
        self._initialized = True
        # Waiting before the init leaves: a prefill worker that has the pages ready answers
        # with its final status before this thread runs again (seen: 1 room in 900).
        self.state.advance(KVPoll.WaitingForInput)
        svc.send_control(self.state.peer, message)

    def poll(self) -> KVPoll:
        self.check_deadline()
        if self._done is not None and not self._landed and self._bell >= 0:
            assert self._doorbells is not None
            if self._doorbells.rung(self._bell, self.room):
                self._landed = True
                self._svc.stats.add(rooms_belled=1)
                self._maybe_succeed()
        return self.state.state

    @property
    def failure_reason(self) -> str | None:
        return self.state.failure_reason

    @property
    def aux(self) -> bytes | None:
        done = self._done
        return done.aux if done is not None and self.state.state == KVPoll.Success else None

    @property
    def regions(self) -> int:
        return self._regions

    @property
    def reusable(self) -> bool:
        if not self._accepts_direct or not self._initialized or self._peer_released:
            return True
        if self.state.state == KVPoll.Success:
            return True
        failed_at = self._failed_at
        return failed_at is not None and time.monotonic() - failed_at > DIRECT_RELEASE_GRACE_S

    def abort(self, reason: str = "aborted") -> None:
        self.fail(reason, tell_peer=True)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.abort("released")
        with self._idle:
            self.accepting = False
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout=RELEASE_WAIT_S):
                logger.error("room %d released with %d writes in flight", self.room, self._inflight)
        self._svc.forget(self.room)

    # ---- driven by the manager and the data plane ----
    def check_deadline(self) -> None:
        reason = self.state.lapsed()
        if reason is not None:
            self.fail(reason, tell_peer=True)

    def fail(self, reason: str, tell_peer: bool) -> None:
        if not self.state.fail(reason):
            return
        self._failed_at = time.monotonic()
        with self.write_lock:
            self.accepting = False
        if tell_peer:
            svc = self._svc
            svc.send_control(self.state.peer, KVAbort(self.room, svc.token, reason))
        self._svc.stats.room_done(self.state)

    def on_done(self, message: KVDone) -> None:
        if self.state.state == KVPoll.Bootstrapping:
            self.fail("final status before init", tell_peer=True)
        elif message.pages != len(self._page_index):
            reason = f"page count mismatch: {message.pages} sent, {len(self._page_index)} asked"
            self.fail(reason, tell_peer=True)
        elif message.direct is not None and not self._accepts_direct:
            self.fail("direct writes into memory that was not offered", tell_peer=True)
        elif not message.landed and (message.direct is None or self._bell < 0):
            self.fail("early final status without direct writes and a doorbell", tell_peer=True)
        elif self._done is not None:
            self.fail("repeated final status", tell_peer=True)
        else:
            if message.direct is not None:  # P wrote the pages itself (landed or ringing)
                self._check_direct(message.direct)
                self._svc.stats.add(direct_rooms=1)
            self._done = message
            self.peer_trace_context = message.traceparent
            self.backend = message.backend
            self._maybe_succeed()

    def _check_direct(self, regions: list[tuple[int, int, int | None]]) -> None:
        """The regions P wrote straight into our memory pass the checks a region frame
        passes (the room's pages, each once; checksums), after the fact."""
        for offset, length, crc in regions:
            frame = RegionFrame(self.room, offset, length, crc)
            try:
                grant = self.claim(frame, self.state.peer)
            except ProtocolViolation:
                return  # the room failed
            if grant is None:
                return
            actual = None
            if self._svc.checksum and self._svc.buffer is not None:
                actual = self._svc.buffer.crc32(offset, length)
            self.written(grant, True, actual)

    def on_landed(self) -> None:
        """P saw the writes of its early final status land."""
        self._landed = True
        self._maybe_succeed()

    def on_released(self) -> None:
        """P will not write into this room's pages again (or P is gone)."""
        self._peer_released = True

    def claim(self, frame: RegionFrame, peer: str) -> Grant | None:
        """Check a region against this room's pages and reserve them; None: drop it."""
        page_bytes = self._svc.page_bytes
        if frame.dst_offset % page_bytes or frame.length % page_bytes:
            raise ProtocolViolation(f"room {self.room}: region not page-aligned")
        first, count = frame.dst_offset // page_bytes, frame.length // page_bytes
        problem = None
        with self._lock:
            if not self.accepting:
                return None
            indices = [self._page_index.get(page) for page in range(first, first + count)]
            if peer != self.state.peer:
                problem = "write from a peer not bound to the room"
            elif any(i is None for i in indices):
                problem = "write outside the room's pages"
            elif any(self._claimed[i] for i in indices if i is not None):
                problem = "page written twice"
            elif self._svc.checksum and frame.crc is None:
                problem = "missing checksum"
            else:
                for i in indices:
                    self._claimed[i] = 1  # type: ignore[index]
        if problem is not None:
            self.fail(problem, tell_peer=True)
            raise ProtocolViolation(f"room {self.room}: {problem}")
        return Grant(self, frame, count)

    def written(self, grant: Grant, ok: bool, crc: int | None) -> None:
        """A claimed write ended; ``crc`` is the checksum of the written bytes, if verified."""
        if not ok:
            self.fail("incomplete region write", tell_peer=True)
            return
        if crc is not None and crc != grant.crc:
            self.fail("checksum mismatch", tell_peer=True)
            return
        with self._lock:
            self._written += grant.pages
            self._regions += 1
        self._svc.stats.add(
            bytes_received=grant.length, pages_received=grant.pages, regions_received=1
        )
        self.state.advance(KVPoll.Transferring)
        self._maybe_succeed()

    def pin(self) -> bool:
        with self.write_lock:
            if not self.accepting:
                return False
            self._inflight += 1
            return True

    def unpin(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def _maybe_succeed(self) -> None:
        with self._lock:
            done = self._done
            landed = done is not None and (done.landed or self._landed)
            complete = landed and self._written == len(self._page_index)
        if complete and self.state.advance(KVPoll.Success):
            with self.write_lock:
                self.accepting = False
            self._svc.stats.room_done(self.state)


class InboundRegions:
    """The ``RegionSink`` of a decode manager: every incoming header is checked here."""

    def __init__(
        self,
        lookup: Callable[[int], ReceiverRoom | None],
        buffer: ByteBuffer,
        services: RoomServices,
        on_peer_lost: Callable[[str], None],
    ):
        self._lookup = lookup
        self._buffer = buffer
        self._svc = services
        self._on_peer_lost = on_peer_lost
        self._token = services.token.encode()

    def hello(self, frame: DataHello) -> bool:
        if hmac.compare_digest(frame.token.encode(), self._token):
            return True
        self.dropped(f"data connection from {frame.peer!r} with a wrong token")
        return False

    def open(self, frame: RegionFrame, peer: str) -> Grant | None:
        if frame.length <= 0 or frame.dst_offset < 0:
            raise ProtocolViolation("empty or negative region")
        if frame.dst_offset + frame.length > self._buffer.nbytes:
            raise ProtocolViolation("region outside the KV buffer")
        room = self._lookup(frame.room)
        if room is None:
            self.dropped(f"region for unknown room {frame.room} from {peer}")
            return None
        return room.claim(frame, peer)

    def close(self, grant: WriteGrant, ok: bool) -> None:
        assert isinstance(grant, Grant)  # (the backends hand back what `open` gave them)
        crc = None
        if ok and self._svc.checksum:
            crc = self._buffer.crc32(grant.offset, grant.length)
        grant.room.written(grant, ok, crc)

    def peer_lost(self, peer: str) -> None:
        self._on_peer_lost(peer)

    def dropped(self, what: str) -> None:
        self._svc.stats.add(frames_dropped=1)
        _dropped_log.warning("kv data plane: dropped %s", what)
