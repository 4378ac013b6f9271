"""The prefill role.

    GenerateReq(room, D) → bootstrap queue ── D's page indices arrive ──▶ prefill queue
    each computed chunk ── complete pages ──▶ transfer workers ──▶ D's pages
    first token ──▶ router at once; ──▶ D with the final status (sender.finish)
    room Success | Failed ──▶ release: radix nodes unlocked, own pages freed

The request's pages stay untouched until its room is terminal, however it ends (after a
failed step, the pages it had are kept with the room while it is recomputed).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from baton.common.cache.kv_pool import KVPool
from baton.common.cache.manager import HeldMemory
from baton.common.config import TransferConfig
from baton.common.disagg.transfer_role import FirstToken, TransferRole, encode_aux
from baton.common.protocol import GenerateReq
from baton.common.state import FinishReason, Req, ScheduledBatch
from baton.common.transfer.base import KVPoll, KVSender

log = logging.getLogger(__name__)


@dataclass
class PrefillRoom:
    req: Req
    sender: KVSender
    room: int
    peer: str  # D's KV-control address
    sent_pages: int = 0  # request pages handed to the sender so far (incl. D's prefix)
    exported: int = 0  # request pages gathered into the wire buffer (TP) so far
    held: list[HeldMemory] = field(default_factory=list)  # pages of before a failed step
    started: float = field(default_factory=time.monotonic)
    first_sent: float = 0.0  # traced: when its first pages went to the sender


class PrefillRole(TransferRole):
    decodes_locally = False

    def __init__(self, pool: KVPool, num_kv_heads: int, config: TransferConfig) -> None:
        super().__init__(pool, num_kv_heads, config, "prefill")
        self.bootstrapping: dict[str, PrefillRoom] = {}
        self.computing: dict[str, PrefillRoom] = {}  # in the scheduler
        self.transferring: dict[str, PrefillRoom] = {}  # first token out, KV in flight

    # -- intake ------------------------------------------------------------------------
    def on_generate(self, msg: GenerateReq) -> None:
        admitted = self.admit_room(msg, "prefill", "decode", self.manager.create_sender)
        if admitted is not None:
            req, sender = admitted
            peer = msg.peer.kv_control_address if msg.peer else ""
            self.bootstrapping[req.rid] = PrefillRoom(req, sender, msg.room, peer)

    def on_abort(self, rid: str) -> None:
        for queue in (self.bootstrapping, self.computing, self.transferring):
            room = queue.pop(rid, None)
            if room is not None:
                room.sender.abort("aborted by the client")
                self._end(room, FinishReason.ABORT, "aborted", queue is self.transferring)
                return
        self.port.abort(rid)

    # -- progress ----------------------------------------------------------------------
    def poll(self) -> None:
        for rid, room in list(self.bootstrapping.items()):
            state = room.sender.poll()
            if state == KVPoll.WaitingForInput:
                del self.bootstrapping[rid]
                self.computing[rid] = room
                self.port.enqueue(room.req)
            elif state == KVPoll.Failed:
                del self.bootstrapping[rid]
                self._end(room, FinishReason.ERROR, room.sender.failure_reason or "failed", False)
        for rid, room in list(self.computing.items()):
            if room.sender.poll() == KVPoll.Failed:  # D went away or aborted
                del self.computing[rid]
                self._end(room, FinishReason.ERROR, room.sender.failure_reason or "failed", False)
        for rid, room in list(self.transferring.items()):
            state = room.sender.poll()
            if state.terminal:
                del self.transferring[rid]
                if state == KVPoll.Failed:
                    self.count_failure(room.sender.failure_reason or "failed")
                self._trace_send(room, detached=True)
                room.sender.release()
                self._release_memory(room)

    def has_work(self) -> bool:
        return bool(self.bootstrapping or self.computing or self.transferring)

    # -- scheduler hooks ---------------------------------------------------------------
    def chunk_computed(
        self, req: Req, computed: int, last: bool, ready: torch.cuda.Event | None
    ) -> None:
        room = self.computing.get(req.rid)
        if room is None:
            return
        prefix = room.sender.prefix_pages or 0
        complete = self._complete_pages(computed, last)
        start = max(room.sent_pages, prefix)
        if complete > start:
            if req.trace is not None and not room.first_sent:
                room.first_sent = time.monotonic()
            try:
                room.sender.send(req.pages[start:complete], start - prefix, ready)
            except ValueError as e:  # D asked for pages that do not fit this prompt
                room.sender.abort(f"bad page request: {e}")
        room.sent_pages = max(room.sent_pages, complete)

    def _complete_pages(self, computed: int, last: bool) -> int:
        """Pages whose KV is final once `computed` tokens are done (the last chunk
        completes the unaligned tail page too)."""
        return -(-computed // self.page_size) if last else computed // self.page_size

    def kv_moves(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        if self.kv_wire is None:
            return [], []
        gather: list[int] = []
        for item in batch.items:
            room = self.computing.get(item.req.rid)
            if room is None or item.end > len(item.req.input_ids):
                continue
            complete = self._complete_pages(item.end, item.sample)
            start = max(room.exported, room.sender.prefix_pages or 0)
            room.exported = max(room.exported, complete)
            gather.extend(item.req.pages[start:complete])
        return [], gather

    def first_token(self, req: Req, reason: FinishReason | None) -> bool:
        room = self.computing.pop(req.rid, None)
        if room is None:
            return False
        logprob = req.logprobs[0] if req.logprobs else None
        room.sender.finish(encode_aux(FirstToken(req.output_ids[0], logprob)))
        self.transferring[req.rid] = room  # the router gets the first token now
        return True

    def keep_memory(self, req: Req, held: HeldMemory) -> bool:
        room = self.computing.get(req.rid)
        if room is None:
            return False
        room.held.append(held)  # the sender may still read these pages
        return True

    # -- endings -----------------------------------------------------------------------
    def _release_memory(self, room: PrefillRoom) -> None:
        self.port.release(room.req, cache=True)
        for held in room.held:
            self.port.release_held(held)
        room.held.clear()

    def _trace_send(self, room: PrefillRoom, detached: bool) -> None:
        """The traced request's span of its pages' trip to D (ended or failed)."""
        sender, prefix = room.sender, room.sender.prefix_pages or 0
        pages = max(0, room.sent_pages - prefix)
        more: dict[str, int | str] = {
            "baton.kv.pages": pages,
            "baton.kv.bytes": pages * self.page_bytes,
            "baton.kv.prefix_pages": prefix,
            "baton.kv.regions": sender.regions,
            "baton.kv.peer": room.peer,
        }
        start = room.first_sent or room.started
        self.trace_room(room.req, "baton.kv_transfer.send", start, sender, detached, **more)

    def _end(self, room: PrefillRoom, reason: FinishReason, error: str, detached: bool) -> None:
        req = room.req
        self.count_failure(error)
        self._trace_send(room, detached)
        room.sender.release()
        if detached:
            self._release_memory(room)
            return
        for held in room.held:
            self.port.release_held(held)
        room.held.clear()
        if not req.finished:
            req.error = error if reason == FinishReason.ERROR else ""
            self.port.finish(req, reason)

    def fail_all(self, reason: str) -> None:
        for queue in (self.bootstrapping, self.computing, self.transferring):
            for room in list(queue.values()):
                room.sender.abort(reason)
                self._end(room, FinishReason.ERROR, reason, queue is self.transferring)
            queue.clear()
        super().fail_all(reason)

    def queue_stats(self) -> dict[str, float]:
        return {
            "queued_disagg": len(self.bootstrapping),
            "bootstrap_queue": len(self.bootstrapping),
            "prefill_computing": len(self.computing),
            "transfer_queue": len(self.transferring),
        }
