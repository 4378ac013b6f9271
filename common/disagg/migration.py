"""Live migration, the source's side: a decode worker hands a running request to another.

    MigrateReq(rid, room, D2) ──▶ a sender room towards D2 (bootstrapping)
    the request's next token that does not end it (`hand_off`) ──▶ taken from the
        scheduler at that step's end: its output ends with that token, "migrated"
    D2's init (its page indices, after its own cached prefix) ──▶ the pages of every
        token but the last (prompt and output) ──▶ the last token as the first-token aux
    room Success | Failed ──▶ the request's pages freed here

D2 asked for exactly those pages with a `Generate` whose prompt is the request's prompt and
output but the last token, naming this worker as its peer: to D2 this worker is a prefill
worker that computed a longer prompt. A request that ends here first (stop, length, abort)
aborts the room, and D2's failed room sends the router to a recompute migration. TP: the
pages would have to be gathered from the ranks first: refused (the room is aborted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.common.disagg.transfer_role import FirstToken, encode_aux
from baton.common.engine.seam import SchedulerPort
from baton.common.protocol import MigrateReq
from baton.common.state import FinishReason, Req
from baton.common.transfer.base import KVPoll, KVSender
from baton.common.transfer.manager import TransferManager

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class Outgoing:
    """One request on its way to another decode worker."""

    rid: str
    sender: KVSender
    req: Req | None = None  # once handed off
    ready: torch.cuda.Event | None = None  # the KV of every token but the last is in
    last: FirstToken | None = None
    sent: bool = False


class MigrationSender:
    """The requests this decode worker hands off (`DecodeRole` asks it)."""

    def __init__(
        self, manager: TransferManager, port: SchedulerPort, page_size: int, tp: bool
    ) -> None:
        self.manager = manager
        self.port = port
        self.page_size = page_size
        self.tp = tp
        self.waiting: dict[str, Outgoing] = {}  # asked to move, still decoding here
        self.sending: dict[str, Outgoing] = {}  # handed off, pages on their way
        self.sent = 0  # requests handed off (cumulative)
        self.pages_sent = 0

    def on_migrate(self, msg: MigrateReq) -> str | None:
        """Take `msg.rid` to hand off at its next token; why not, if refused (its room
        aborted: the scheduler tells the frontend, which tells the router at once)."""
        sender = self.manager.create_sender(msg.room, msg.peer.kv_control_address)
        if self.tp:
            refused = "live migration from a tensor-parallel worker is not supported"
        elif msg.rid in self.waiting or msg.rid in self.sending:
            refused = f"request {msg.rid} is moving already"
        else:
            self.waiting[msg.rid] = Outgoing(msg.rid, sender)
            return None
        sender.abort(refused)
        sender.release()
        return refused

    def hand_off(
        self, req: Req, reason: FinishReason | None, ready: torch.cuda.Event | None
    ) -> bool:
        out = self.waiting.pop(req.rid, None)
        if out is None:
            return False
        if reason is not None or out.sender.poll() == KVPoll.Failed:
            self._drop(out, "the request ended on its worker first")
            return False
        logprob = req.logprobs[-1] if req.sampling.logprobs and req.logprobs else None
        out.req, out.ready = req, ready
        out.last = FirstToken(req.output_ids[-1], logprob)
        self.sending[req.rid] = out
        self.sent += 1
        return True

    def on_abort(self, rid: str) -> None:
        out = self.waiting.pop(rid, None)
        if out is not None:
            self._drop(out, "aborted by the client")

    def poll(self) -> None:
        for rid, out in list(self.waiting.items()):
            if out.sender.poll() == KVPoll.Failed:  # the target gave up before the hand-off
                del self.waiting[rid]
                self._drop(out, out.sender.failure_reason or "failed")
        for rid, out in list(self.sending.items()):
            state = out.sender.poll()
            if state == KVPoll.WaitingForInput and not out.sent:
                self._send(out)
            elif state.terminal:
                del self.sending[rid]
                if state == KVPoll.Failed:
                    log.warning("live migration of %s failed: %s", rid, out.sender.failure_reason)
                out.sender.release()
                assert out.req is not None
                self.port.release(out.req, cache=False)

    def _send(self, out: Outgoing) -> None:
        req, last = out.req, out.last
        assert req is not None and last is not None
        out.sent = True
        kv_tokens = len(req.input_ids) + len(req.output_ids) - 1  # all but the last token
        pages = -(-kv_tokens // self.page_size)
        prefix = out.sender.prefix_pages or 0
        try:
            out.sender.send(req.pages[prefix:pages], 0, out.ready)
            out.sender.finish(encode_aux(last))
        except ValueError as e:  # the target asked for pages that do not fit the request
            out.sender.abort(f"bad page request: {e}")
            return
        self.pages_sent += pages - prefix

    def _drop(self, out: Outgoing, reason: str) -> None:
        out.sender.abort(reason)
        out.sender.release()

    def has_work(self) -> bool:
        return bool(self.waiting or self.sending)

    def fail_all(self, reason: str) -> None:
        for out in list(self.waiting.values()):
            self._drop(out, reason)
        self.waiting.clear()
        for out in list(self.sending.values()):
            self._drop(out, reason)
            if out.req is not None:
                self.port.release(out.req, cache=False)
        self.sending.clear()
