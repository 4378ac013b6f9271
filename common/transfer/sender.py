"""P's side: the sender of one room.

The scheduler calls ``send`` after each prefill chunk with the pages that became complete,
then ``finish`` with the first token. Both only validate and queue: a transfer worker (see
``workers``) coalesces and pushes the pages, and sends the final status once every queued
page is written. A room's jobs all go to one worker thread, so its finish runs after its
sends. Where D's doorbells are mapped, ``finish`` sends the final status at once instead
(``announce``) and the room's bell tells D when the writes landed (see doorbell).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from baton.common.transfer.base import KVPoll, KVSender
from baton.common.transfer.messages import (
    KVAbort,
    KVDone,
    KVInit,
    KVLanded,
    KVReleased,
    RegionFrame,
)
from baton.common.transfer.regions import coalesce
from baton.common.transfer.room import RoomServices, RoomState


@dataclass(frozen=True, slots=True)
class Launched:
    """Writes already queued on the GPU by the thread that sent the pages (see workers)."""

    frames: list[RegionFrame]
    done: torch.cuda.Event  # fires once every byte landed in D's pool


@dataclass(frozen=True, slots=True)
class SendJob:
    room: SenderRoom
    pairs: list[tuple[int, int]]  # (source page, destination page)
    ready: torch.cuda.Event | None = None  # the source pages are final once it fired
    launched: Launched | None = None  # None: the lane pushes the pairs itself


@dataclass(frozen=True, slots=True)
class FinishJob:
    room: SenderRoom


@dataclass(frozen=True, slots=True)
class ReleaseJob:
    """After a room failed: tell D once this lane will not touch its pages again."""

    room: SenderRoom


Job = SendJob | FinishJob | ReleaseJob


class SenderRoom(KVSender):
    def __init__(self, room: int, peer: str, services: RoomServices, submit: Callable[[Job], None]):
        self.room = room
        self.state = RoomState(room, peer, services.deadlines)
        self._svc = services
        self._submit = submit
        self._lock = threading.Lock()
        self._dst: list[int] | None = None
        self._prefix: int | None = None
        self._sent = bytearray()
        self._sent_count = 0
        self._finishing = False
        self._aux: bytes | None = None
        self._regions = 0
        self._released = False
        self.transfer_address = ""  # D's data-plane address, from its init
        self.checksum = services.checksum
        self.lane: int | None = None  # the worker thread that owns this room's jobs
        self._direct: list[tuple[int, int, int | None]] = []  # regions written into D
        self.bell = -1  # D's doorbell slot (from its init); -1: none
        self.all_launched = True  # every send's copies were queued by the sending thread
        self.announced = False  # the final status left before the writes landed
        self.rung = False  # the bell is queued on the GPU behind the writes

    # ---- KVSender ----
    @property
    def num_dst_pages(self) -> int | None:
        return None if self._dst is None else len(self._dst)

    @property
    def prefix_pages(self) -> int | None:
        return self._prefix

    @property
    def regions(self) -> int:
        return self._regions

    @property
    def failure_reason(self) -> str | None:
        return self.state.failure_reason

    def poll(self) -> KVPoll:
        self.check_deadline()
        return self.state.state

    def send(
        self, src_page_ids: Sequence[int], dst_start: int, ready: torch.cuda.Event | None = None
    ) -> None:
        if self._ready_for("send") is None:
            return
        dst = self._dst
        assert dst is not None
        src = [int(p) for p in src_page_ids]
        if any(not 0 <= p < self._svc.num_pages for p in src):
            raise ValueError(f"room {self.room}: source page out of range")
        if dst_start < 0 or dst_start + len(src) > len(dst):
            raise ValueError(
                f"room {self.room}: pages [{dst_start}, {dst_start + len(src)}) "
                f"outside the {len(dst)} destination pages"
            )
        with self._lock:
            span = range(dst_start, dst_start + len(src))
            if any(self._sent[i] for i in span):
                raise ValueError(f"room {self.room}: a destination page was sent twice")
            for i in span:
                self._sent[i] = 1
            self._sent_count += len(src)
        if not src:
            return
        self.state.advance(KVPoll.Transferring)
        self._svc.stats.add(sends=1)
        pairs = [(s, dst[dst_start + i]) for i, s in enumerate(src)]
        self._submit(SendJob(self, pairs, ready))

    def finish(self, aux: bytes) -> None:
        if self._ready_for("finish") is None:
            return
        assert self._dst is not None
        if self._sent_count != len(self._dst):
            raise ValueError(
                f"room {self.room}: finish() after {self._sent_count} of {len(self._dst)} pages"
            )
        self._finishing = True
        self._aux = aux
        self.state.advance(KVPoll.Transferring)
        self._submit(FinishJob(self))

    def abort(self, reason: str = "aborted") -> None:
        self.fail(reason, tell_peer=True)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.abort("released")
        self._svc.forget(self.room)

    # ---- driven by the manager and the transfer workers ----
    def bootstrap(self, init: KVInit) -> None:
        """D's init arrived (control thread)."""
        if init.page_bytes != self._svc.page_bytes:
            reason = f"layout mismatch: page_bytes {init.page_bytes} != {self._svc.page_bytes}"
            self.fail(reason, tell_peer=True)
            return
        if init.prefix_pages < 0 or self.state.state != KVPoll.Bootstrapping:
            self.fail("bad or repeated init", tell_peer=True)
            return
        self._dst = list(init.dst_page_ids)
        self._prefix = init.prefix_pages
        self._sent = bytearray(len(self._dst))
        self.transfer_address = init.transfer_address
        self.checksum = self.checksum or init.checksum
        self.bell = init.bell
        self.peer_trace_context = init.traceparent
        self.state.advance(KVPoll.WaitingForInput)

    def check_deadline(self) -> None:
        reason = self.state.lapsed()
        if reason is not None:
            self.fail(reason, tell_peer=True)

    def fail(self, reason: str, tell_peer: bool) -> None:
        if not self.state.fail(reason):
            return
        if tell_peer:
            self._svc.send_control(self.state.peer, KVAbort(self.room, self._svc.token, reason))
        self._svc.stats.room_done(self.state)
        if self.lane is None:  # nothing was ever queued: nothing can still be written
            self.released()
        else:  # after whatever the room's lane is pushing now
            try:
                self._submit(ReleaseJob(self))
            except RuntimeError:  # shutting down: the lanes are stopping
                self.released()

    def released(self) -> None:
        """No byte of this room will be written any more (lane thread, or at once)."""
        self._svc.send_control(self.state.peer, KVReleased(self.room, self._svc.token))

    def pushed(self, frames: Sequence[RegionFrame], direct: bool) -> None:
        """A transfer worker wrote these regions (`direct`: into D's memory itself)."""
        self._regions += len(frames)
        if direct:
            self._direct.extend((f.dst_offset, f.length, f.crc) for f in frames)

    def announce(self) -> None:
        """Send the final status now, before the writes landed: every page is queued and D
        waits for the room's bell (or ``KVLanded``). Direct writes only (ipc), no checksums."""
        assert self._dst is not None and self.bell >= 0 and not self.checksum
        # finish() checked that every destination page was sent: their runs are the regions
        runs = coalesce(((page, page) for page in self._dst), self._svc.page_bytes)
        regions: list[tuple[int, int, int | None]] = [(r.dst_offset, r.length, None) for r in runs]
        done = self._final_status(regions, landed=False)
        self.announced = True
        self._svc.send_control(self.state.peer, done)

    def complete(self, deliver: bool, direct: bool) -> None:
        """Every page is written (`direct`: straight into D's memory): send the final
        status (unless a fault plan drops it), or after ``announce`` say they landed."""
        if self.state.state.terminal:
            return
        if deliver and self.announced:
            self._svc.send_control(self.state.peer, KVLanded(self.room, self._svc.token))
        elif deliver:
            regions = self._direct if direct or self._direct else None
            done = self._final_status(regions, landed=True)
            self._svc.send_control(self.state.peer, done)
        if self.state.advance(KVPoll.Success):
            self._svc.stats.room_done(self.state)

    def _final_status(
        self, regions: list[tuple[int, int, int | None]] | None, landed: bool
    ) -> KVDone:
        assert self._dst is not None
        return KVDone(
            self.room,
            self._svc.token,
            len(self._dst),
            self._aux,
            regions,
            landed,
            traceparent=self.trace_context,
            backend=self.backend,
        )

    def _ready_for(self, call: str) -> KVPoll | None:
        """Checks shared by send and finish; None means: the room failed, ignore the call."""
        state = self.state.state
        if state == KVPoll.Failed:
            return None
        if state == KVPoll.Bootstrapping:
            raise RuntimeError(f"room {self.room}: {call}() before D's init arrived")
        if self._finishing or state == KVPoll.Success:
            raise RuntimeError(f"room {self.room}: {call}() after finish()")
        return state
