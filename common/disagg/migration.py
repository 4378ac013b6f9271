"""Live migration, the source's side: a decode worker hands a running request to another.

    MigrateReq(rid, room, D2, precopy_tokens=n) ──▶ a pre-copy, no hand-off: a sender room
        towards D2; D2's init ──▶ the pages of the context's first n tokens (whole pages,
        after D2's own cached prefix) ──▶ the token at n as the first-token aux; the request
        decodes on here all along
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

A pre-copy warms D2's prefix cache before the hand-off (the router's `precopy.py`): D2 asked
for its pages with a one-token `Generate` of the context's first n tokens and caches them
when that ends, so the hand-off then sends only the pages written since. The pages copied
ahead hold finished KV (their tokens were computed steps before) that does not change while
the request runs; a request that ends or is aborted before the room succeeded aborts it, so
that D2 caches nothing from pages freed under the copy.

A pre-copy's pages must stay unchanged until its room ends (`KVSender`), and a request may
be retracted here (memory) or recomputed (a failed step) while they are on the wire. Its
memory then passes through `keep_memory` (the decode role's hook): once the pages were
sent, the pre-copy keeps it (the full pages cached in the prefix cache under a lock, the
rest as the request's own pages) and gives it back when the room ends, successful or not,
so no other request is given those pages while the transfer may read them; the room goes
on and D2 caches the pages. A pre-copy that has not sent yet keeps nothing and waits for
the recomputed request's next token (its pages, `ready`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.common.cache.manager import HeldMemory
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


@dataclass
class Precopy:
    """The pages of a request's first `tokens` tokens, on their way ahead of its hand-off."""

    rid: str
    sender: KVSender
    tokens: int  # whole pages of its context
    req: Req | None = None  # as of the last step's end; None while it is recomputed
    ready: torch.cuda.Event | None = None
    sent: bool = False
    held: HeldMemory | None = None  # taken from the request while its pages are read


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
        self.precopying: dict[str, Precopy] = {}  # pages copied ahead, decoding here
        self.sent = 0  # requests handed off (cumulative)
        self.pages_sent = 0  # at hand-offs (cumulative)
        self.pages_precopied = 0

    def on_migrate(self, msg: MigrateReq) -> str | None:
        """Take `msg.rid` to hand off at its next token (or to pre-copy); why not, if
        refused (its room aborted: the scheduler tells the frontend, which tells the router
        at once)."""
        sender = self.manager.create_sender(msg.room, msg.peer.kv_control_address)
        if self.tp:
            refused = "live migration from a tensor-parallel worker is not supported"
        elif msg.precopy_tokens % self.page_size:
            refused = f"a pre-copy covers whole pages of {self.page_size} tokens"
        elif msg.precopy_tokens and msg.rid in self.precopying:
            refused = f"request {msg.rid} is being pre-copied already"
        elif msg.precopy_tokens:
            self.precopying[msg.rid] = Precopy(msg.rid, sender, msg.precopy_tokens)
            return None
        elif msg.rid in self.waiting or msg.rid in self.sending:
            refused = f"request {msg.rid} is moving already"
        else:
            self.waiting[msg.rid] = Outgoing(msg.rid, sender)
            return None
        _drop(sender, refused)
        return refused

    def hand_off(
        self, req: Req, reason: FinishReason | None, ready: torch.cuda.Event | None
    ) -> bool:
        copy = self.precopying.get(req.rid)
        if copy is not None and reason is None:
            copy.req, copy.ready = req, ready
        elif copy is not None:  # its pages are freed now: D2 must not cache what lands
            self._end_precopy(copy, "the request ended on its worker first")
        out = self.waiting.pop(req.rid, None)
        if out is None:
            return False
        if reason is not None or out.sender.poll() == KVPoll.Failed:
            _drop(out.sender, "the request ended on its worker first")
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
            _drop(out.sender, "aborted by the client")
        copy = self.precopying.get(rid)
        if copy is not None:
            self._end_precopy(copy, "aborted by the client")

    def keep_memory(self, req: Req, held: HeldMemory) -> bool:
        """The scheduler takes `req`'s memory to recompute it (retracted, or its step
        failed): a pre-copy whose pages are on the wire keeps it until its room ends."""
        copy = self.precopying.get(req.rid)
        if copy is None:
            return False
        if not copy.sent:  # nothing read yet: send the recomputed request's pages
            copy.req = copy.ready = None
            return False
        if copy.held is not None or copy.sender.poll().terminal:
            return False  # the pages read are kept already, or no longer read
        copy.held = held
        return True

    def poll(self) -> None:
        for rid, out in list(self.waiting.items()):
            if out.sender.poll() == KVPoll.Failed:  # the target gave up before the hand-off
                del self.waiting[rid]
                _drop(out.sender, out.sender.failure_reason or "failed")
        for rid, copy in list(self.precopying.items()):
            state = copy.sender.poll()
            if state == KVPoll.WaitingForInput and not copy.sent and copy.req is not None:
                self._precopy(copy, copy.req)
            elif state.terminal:
                if state == KVPoll.Failed:
                    log.info("pre-copy of %s failed: %s", rid, copy.sender.failure_reason)
                self._end_precopy(copy)
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

    def _precopy(self, copy: Precopy, req: Req) -> None:
        copy.sent = True
        pages = copy.tokens // self.page_size
        prefix = copy.sender.prefix_pages or 0
        prompt = len(req.input_ids)
        if copy.tokens < prompt:
            after = req.input_ids[copy.tokens]
        elif copy.tokens < prompt + len(req.output_ids):
            after = req.output_ids[copy.tokens - prompt]
        else:
            copy.sender.abort(f"the request holds fewer than {copy.tokens + 1} tokens")
            return
        try:
            copy.sender.send(req.pages[prefix:pages], 0, copy.ready)
            copy.sender.finish(encode_aux(FirstToken(after, None)))
        except ValueError as e:  # the target asked for pages that do not fit the request
            copy.sender.abort(f"bad page request: {e}")
            return
        self.pages_precopied += pages - prefix

    def _end_precopy(self, copy: Precopy, abort: str | None = None) -> None:
        """Forget the pre-copy, its room aborted first (`abort`) unless it ended: the pages
        it kept go back to the pool once the room is terminal (a failed room's pages are
        never used by D2)."""
        del self.precopying[copy.rid]
        if abort is not None:
            copy.sender.abort(abort)
        copy.sender.release()
        if copy.held is not None:
            self.port.release_held(copy.held)
            copy.held = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.sending or self.precopying)

    def fail_all(self, reason: str) -> None:
        for out in list(self.waiting.values()):
            _drop(out.sender, reason)
        self.waiting.clear()
        for copy in list(self.precopying.values()):
            self._end_precopy(copy, reason)
        for out in list(self.sending.values()):
            _drop(out.sender, reason)
            if out.req is not None:
                self.port.release(out.req, cache=False)
        self.sending.clear()


def _drop(sender: KVSender, reason: str) -> None:
    sender.abort(reason)
    sender.release()
