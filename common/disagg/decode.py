"""The decode role.

    GenerateReq(room, P) → prealloc queue ── KV budget allows ──▶ pages allocated
        (reusing D's own radix-cache prefix with --decode-radix-cache: only the
         missing pages travel) ── page indices ──▶ P
    transfer queue: poll the room ── Success ──▶ joins the running batch with P's
        first token ── Failed ──▶ pages freed, the request ends with an error

The first token is not streamed from here (the router has it from P); tokens 2..n are.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from baton.common.config import TransferConfig
from baton.common.disagg.common import TransferRoleHandler, decode_aux
from baton.common.engine.req import FinishReason, Req, TokenLogprob
from baton.common.engine.scheduler import Scheduler
from baton.common.protocol import GenerateReq
from baton.common.transfer.base import KVPoll, KVReceiver

log = logging.getLogger(__name__)


@dataclass
class DecodeRoom:
    req: Req
    receiver: KVReceiver
    room: int
    arrived: float = field(default_factory=time.monotonic)
    initiated: float = 0.0
    prefix_pages: int = 0  # pages D had in its own prefix cache


class DecodeHandler(TransferRoleHandler):
    def __init__(self, scheduler: Scheduler, config: TransferConfig) -> None:
        super().__init__(scheduler, config, "decode")
        self.prealloc: deque[DecodeRoom] = deque()
        self.transferring: dict[str, DecodeRoom] = {}

    def on_generate(self, msg: GenerateReq) -> None:
        admitted = self.admit_room(msg, "decode", "prefill", self.manager.create_receiver)
        if admitted is not None:
            req, receiver = admitted
            self.prealloc.append(DecodeRoom(req, receiver, msg.room))

    def on_abort(self, rid: str) -> None:
        for room in list(self.prealloc):
            if room.req.rid == rid:
                self.prealloc.remove(room)
                self._fail(room, "aborted by the client", FinishReason.ABORT)
                return
        found = self.transferring.pop(rid, None)
        if found is not None:
            self._fail(found, "aborted by the client", FinishReason.ABORT)
            return
        self.scheduler.abort(rid)

    def poll(self) -> None:
        self._admit()
        for rid, room in list(self.transferring.items()):
            state = room.receiver.poll()
            if state == KVPoll.Success:
                del self.transferring[rid]
                self._join(room)
            elif state == KVPoll.Failed:
                del self.transferring[rid]
                self._fail(room, room.receiver.failure_reason or "transfer failed")

    def _admit(self) -> None:
        """Preallocate pages, first come first served, while the KV budget allows."""
        cache = self.scheduler.cache
        while self.prealloc:
            room = self.prealloc[0]
            if room.receiver.poll() == KVPoll.Failed:  # P refused or aborted early
                self.prealloc.popleft()
                self._fail(room, room.receiver.failure_reason or "transfer failed")
                continue
            req = room.req
            running = len(self.scheduler.decode.running) + len(self.transferring)
            if cache.table.num_free == 0 or running >= self.scheduler.cfg.max_running_requests:
                return
            reserve = self.scheduler.decode.reserved_pages()
            cache.admit(req)
            need = cache.pages_for(req, len(req.input_ids) - req.device_len)
            decode_room = -(
                -min(req.sampling.max_new_tokens, self.scheduler.cfg.decode_reserve_tokens)
                // cache.page_size
            )
            if need + decode_room + reserve > cache.available_pages():
                cache.release(req, cache=False)
                return
            self.prealloc.popleft()
            cache.extend(req, len(req.input_ids) - req.device_len)
            prefix_pages = req.cached_len // cache.page_size
            room.receiver.init(req.pages[prefix_pages:], prefix_pages)
            room.prefix_pages = prefix_pages
            room.initiated = time.monotonic()
            req.times["decode_admission"] = room.initiated - room.arrived
            self.transferring[req.rid] = room

    def _join(self, room: DecodeRoom) -> None:
        req = room.req
        req.times["kv_transfer"] = time.monotonic() - room.initiated
        try:
            first = decode_aux(room.receiver.aux or b"")
        except msgspec.DecodeError:
            self._fail(room, "malformed first token from the prefill worker")
            return
        room.receiver.release()
        req.output_ids.append(first.token_id)
        if first.logprob is not None and req.sampling.logprobs:
            lp = first.logprob
            req.logprobs.append(TokenLogprob(lp.token_id, lp.logprob, list(lp.top)))
        req.times["first_token"] = time.monotonic()
        if self.scheduler.runner.wire is not None:  # TP: hand each rank its KV heads
            self.scheduler.kv_import.extend(req.pages[room.prefix_pages :])
        self.scheduler.cache.cache_prefix(req)
        self.scheduler.join_running(req)

    def _fail(
        self, room: DecodeRoom, reason: str, finish: FinishReason = FinishReason.ERROR
    ) -> None:
        room.receiver.abort(reason)
        room.receiver.release()
        self.count_failure(reason)
        req = room.req
        if finish == FinishReason.ERROR:
            req.error = f"KV transfer failed: {reason}"
        self.scheduler.finish(req, finish)

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring)

    def fail_all(self, reason: str) -> None:
        while self.prealloc:
            self._fail(self.prealloc.popleft(), reason)
        for room in list(self.transferring.values()):
            self._fail(room, reason)
        self.transferring.clear()
        super().fail_all(reason)

    def queue_stats(self) -> dict[str, float]:
        return {
            "queued_disagg": len(self.prealloc),
            "prealloc_queue": len(self.prealloc),
            "transfer_queue": len(self.transferring),
        }
