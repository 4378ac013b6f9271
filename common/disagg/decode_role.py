"""The decode role.

    GenerateReq(room, P) → prealloc queue ── port.reserve: the KV budget allows ──▶ pages
        (reusing D's own radix-cache prefix with --decode-radix-cache: only the missing
         pages travel) ── page indices ──▶ P
    transfer queue: poll the room ── Success ──▶ joins the running batch with P's
        first token ── Failed ──▶ pages freed, the request ends with an error

After a failed room, its pages return to the pool only once no byte can land in them any
more (`KVReceiver.reusable`: with direct writes, once P released the room).

Back-pressure: a room waits in the prealloc queue (first come, first served) until the
pool has room for its prompt and its decode reserve; reserved rooms count toward the
running cap and the decode reserve, so they never take a running request's pages.
The first token is not streamed from here (the router has it from P); tokens 2..n are.

Live migration (`migration.py`): a running request is handed to another decode worker,
its pages sent as a prefill worker sends a prompt's (`MigrateReq`, the `hand_off` hook).

Local prefill (the router's `local` placement): a request without a room or a peer is
computed here, as the aggregated worker computes it (its cached prefix reused), then
decodes here; while it computes, no room is reserved. How much of it a step computes
beside the running requests is the slack rule's (`slack.py`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec
import torch

from baton.common.cache.kv_pool import KVPool
from baton.common.cache.manager import HeldMemory
from baton.common.config import TransferConfig
from baton.common.disagg.aggregated_role import Role
from baton.common.disagg.migration import MigrationSender
from baton.common.disagg.slack import (
    PROBE_TOKENS,
    LatePrompts,
    SlackPlan,
    tokens_to_come,
    tpot_slack,
)
from baton.common.disagg.transfer_role import TransferRole, decode_aux
from baton.common.engine.seam import SchedulerPort
from baton.common.engine.step_clock import StepBudget, StepClock
from baton.common.protocol import GenerateReq, MigrateReq, PeerInfo
from baton.common.state import FinishReason, Req, ScheduledBatch
from baton.common.step_times import MAX_STALL_SLOS, SLACK_MARGIN
from baton.common.transfer.base import KVPoll, KVReceiver

log = logging.getLogger(__name__)


@dataclass
class DecodeRoom:
    req: Req
    receiver: KVReceiver
    room: int
    peer: str  # P's KV-control address
    arrived: float = field(default_factory=time.monotonic)
    initiated: float = 0.0
    prefix_pages: int = 0  # pages D had in its own prefix cache


class DecodeRole(TransferRole):
    def __init__(
        self, pool: KVPool, num_kv_heads: int, config: TransferConfig, tpot_slo: float = 0.02
    ) -> None:
        super().__init__(pool, num_kv_heads, config, "decode")
        self.tpot_slo = tpot_slo
        self.local_prefills = 0  # requests computed here (cumulative)
        self.handed_back = 0  # of those, ended unstarted for the router to place again
        # local prompts placed with a start_within: each starts within it or is handed
        # back, and once started none waits past its TTFT SLO
        self.late = LatePrompts()
        # the slack rule's latest view, for the worker's metrics: the decode step it
        # planned with (s), its running requests' least slack (s), the answer length it
        # plans with (tokens; 0 until enough answers are known)
        self.plan = SlackPlan()
        self.prealloc: deque[DecodeRoom] = deque()
        self.transferring: dict[str, DecodeRoom] = {}
        self.kv_import: list[int] = []  # TP: received pages to scatter before the next step
        # failed rooms whose pages P may still be writing (direct writes): kept out of use
        self.draining: list[tuple[KVReceiver, HeldMemory | None]] = []
        self.outgoing: MigrationSender | None = None  # live migrations away (bound with port)

    def bind(self, port: SchedulerPort) -> None:
        super().bind(port)
        self.outgoing = MigrationSender(
            self.manager, port, self.page_size, tp=self.kv_wire is not None
        )

    def on_migrate(self, msg: MigrateReq) -> str | None:
        assert self.outgoing is not None
        return self.outgoing.on_migrate(msg)

    def connect(self, peer: PeerInfo) -> Future[None] | None:
        if self.kv_wire is not None or not peer.transfer_address:
            return None  # TP: live migration is refused anyway
        return self.manager.connect(peer.transfer_address)

    def hand_off(
        self, req: Req, reason: FinishReason | None, ready: torch.cuda.Event | None
    ) -> bool:
        return self.outgoing is not None and self.outgoing.hand_off(req, reason, ready)

    def chunk_computed(
        self, req: Req, computed: int, last: bool, ready: torch.cuda.Event | None
    ) -> None:
        self.late.computed(req, last)

    def keep_memory(self, req: Req, held: HeldMemory) -> bool:
        return self.outgoing is not None and self.outgoing.keep_memory(req, held)

    def on_generate(self, msg: GenerateReq) -> None:
        if not msg.room and msg.peer is None:  # placed here whole: prefill locally
            self.local_prefills += 1
            Role.on_generate(self, msg)
            if msg.start_within > 0:
                received = msg.received_at or time.monotonic()
                self.late.placed(msg.rid, received, msg.start_within)
            return
        admitted = self.admit_room(msg, "decode", "prefill", self.manager.create_receiver)
        if admitted is not None:
            req, receiver = admitted
            peer = msg.peer.kv_control_address if msg.peer else ""
            self.prealloc.append(DecodeRoom(req, receiver, msg.room, peer))

    def on_abort(self, rid: str) -> None:
        self.late.forget(rid)
        for room in list(self.prealloc):
            if room.req.rid == rid:
                self.prealloc.remove(room)
                self._fail(room, "aborted by the client", FinishReason.ABORT)
                return
        found = self.transferring.pop(rid, None)
        if found is not None:
            self._fail(found, "aborted by the client", FinishReason.ABORT)
            return
        if self.outgoing is not None:
            self.outgoing.on_abort(rid)
        self.port.abort(rid)

    def poll(self) -> None:
        self._drain()
        self._hand_back()
        self._admit()
        if self.outgoing is not None:
            self.outgoing.poll()
        for rid, room in list(self.transferring.items()):
            state = room.receiver.poll()
            if state == KVPoll.Success:
                del self.transferring[rid]
                self._join(room)
            elif state == KVPoll.Failed:
                del self.transferring[rid]
                self._fail(room, room.receiver.failure_reason or "transfer failed")

    def _hand_back(self) -> None:
        """End the local prompts whose `start_within` passed before their first prompt step
        (finish reason `HANDED_BACK`: the router places them again, elsewhere)."""
        if not self.late.start_by:
            return
        for rid in self.late.windows_passed(time.monotonic()):
            if self.port.withdraw(rid, FinishReason.HANDED_BACK):  # (False: it started)
                self.handed_back += 1
                log.debug("request %s: not started within its start_within; handed back", rid)

    def _admit(self) -> None:
        """Reserve pages, first come first served, while the KV budget allows."""
        while self.prealloc:
            room = self.prealloc[0]
            if room.receiver.poll() == KVPoll.Failed:  # P refused or aborted early
                self.prealloc.popleft()
                self._fail(room, room.receiver.failure_reason or "transfer failed")
                continue
            req = room.req
            if not self.port.reserve(req):
                return
            self.prealloc.popleft()
            prefix_pages = req.cached_len // self.page_size
            room.receiver.init(req.pages[prefix_pages:], prefix_pages)
            room.prefix_pages = prefix_pages
            room.initiated = time.monotonic()
            req.times["decode_admission"] = room.initiated - room.arrived
            self.transferring[req.rid] = room

    def _trace_receive(self, room: DecodeRoom) -> None:
        """The traced request's span of its pages' trip from P (ended or failed)."""
        if room.req.trace is None or not room.initiated:
            return
        pages = len(room.req.pages) - room.prefix_pages
        more: dict[str, int | str] = {
            "baton.kv.pages": pages,
            "baton.kv.bytes": pages * self.page_bytes,
            "baton.kv.prefix_pages": room.prefix_pages,
            "baton.kv.peer": room.peer,
            "baton.kv.regions": room.receiver.regions,
        }
        self.trace_room(
            room.req, "baton.kv_transfer.receive", room.initiated, room.receiver, False, **more
        )

    def _join(self, room: DecodeRoom) -> None:
        req = room.req
        req.times["kv_transfer"] = time.monotonic() - room.initiated
        self._trace_receive(room)
        try:
            first = decode_aux(room.receiver.aux or b"")
        except msgspec.DecodeError:
            self._fail(room, "malformed first token from the prefill worker")
            return
        room.receiver.release()
        req.output_ids.append(first.token_id)
        if first.logprob is not None and req.sampling.logprobs:
            req.logprobs.append(first.logprob)
        req.times["first_token"] = time.monotonic()
        if self.kv_wire is not None:  # TP: hand each rank its KV heads
            self.kv_import.extend(req.pages[room.prefix_pages :])
        self.port.join_running(req)

    def prefill_budget(self, running: Sequence[Req], clock: StepClock) -> StepBudget | None:
        if not running:
            clock.times.decode_slack = 0.0
            self.plan = SlackPlan(answer_tokens=clock.answers.typical)
            return None  # no running request's TPOT is at stake
        # at its rows' contexts, which grow as they decode (a line at small batches of short
        # contexts would see slack where the KV reads already spend it), and with the rows
        # whose KV is on its way: they join within a transfer and decode beside the running
        # ones to their end, so slack spent now as if they were not coming is theirs
        # (Mooncake x8 on 2x H200: D's TPOT p50 was 21.8 ms with local prompts, 17.6 without)
        joining = [room.req for room in self.transferring.values()]
        decode_step = clock.decode_step(
            len(running) + len(joining),
            sum(r.device_len for r in running) + sum(len(r.input_ids) for r in joining),
        )
        now, slo = time.monotonic(), SLACK_MARGIN * self.tpot_slo
        slack, least = min(
            (tpot_slack(r, now, decode_step, slo, clock.answers), i) for i, r in enumerate(running)
        )
        clock.times.decode_slack = max(0.0, min(slack, 1e6))  # (inf: nobody has a TPOT yet)
        clock.times.slack_tokens = float(tokens_to_come(running[least], clock.answers))
        self.plan = SlackPlan(decode_step, clock.times.decode_slack, clock.answers.typical)
        # The step decodes the running rows too: their decode step is spent anyway, the
        # prompt's chunk may add what their slack allows, within the ceiling.
        spend = min(MAX_STALL_SLOS * self.tpot_slo - decode_step, slack)
        if spend <= 0:
            budget = StepBudget(tokens=0)
        elif not clock.prefill.ready:
            return StepBudget(tokens=PROBE_TOKENS)
        else:
            budget = StepBudget(spend, clock.prefill.line().marginal)
        late = self.late.late_context(now)
        if late is not None and _grants(budget, late) < PROBE_TOKENS:
            return StepBudget(tokens=PROBE_TOKENS)  # (`slack.py`: a started prompt goes on)
        return budget

    def kv_moves(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        pages, self.kv_import = self.kv_import, []
        return pages, []

    def _fail(
        self, room: DecodeRoom, reason: str, finish: FinishReason = FinishReason.ERROR
    ) -> None:
        receiver, req = room.receiver, room.req
        receiver.abort(reason)
        self.count_failure(reason)
        self._trace_receive(room)
        if finish == FinishReason.ERROR:
            req.error = f"KV transfer failed: {reason}"
        if receiver.reusable:
            receiver.release()
            self.port.finish(req, finish)
            return
        # P may still be writing into the pages: the request ends now, the pages wait
        held = self.port.take_memory(req)
        self.port.finish(req, finish)
        self.draining.append((receiver, held))

    def _drain(self) -> None:
        for entry in list(self.draining):
            receiver, held = entry
            if receiver.reusable:
                self.draining.remove(entry)
                receiver.release()
                if held is not None:
                    self.port.release_held(held)

    def has_work(self) -> bool:
        moving = self.outgoing is not None and self.outgoing.has_work()
        return bool(self.prealloc or self.transferring or self.draining or moving)

    def fail_all(self, reason: str) -> None:
        while self.prealloc:
            self._fail(self.prealloc.popleft(), reason)
        for room in list(self.transferring.values()):
            self._fail(room, reason)
        self.transferring.clear()
        if self.outgoing is not None:
            self.outgoing.fail_all(reason)
        super().fail_all(reason)

    def queue_stats(self) -> dict[str, float]:
        return {
            "queued_disagg": len(self.prealloc),
            "prealloc_queue": len(self.prealloc),
            "transfer_queue": len(self.transferring),
            "local_prefills": self.local_prefills,
            "local_handed_back": self.handed_back,
            "planned_decode_step_seconds": self.plan.decode_step,
            "least_slack_seconds": self.plan.least_slack,
            "planned_answer_tokens": self.plan.answer_tokens,
            "migrations_out": self.outgoing.sent if self.outgoing is not None else 0,
        } | self._migration_pages()

    def _migration_pages(self) -> dict[str, float]:
        """Pages sent to targets of live migrations: ahead (pre-copy), at the hand-off."""
        out = self.outgoing
        return {
            "migration_pages_out:precopy": out.pages_precopied if out is not None else 0,
            "migration_pages_out:cutover": out.pages_sent if out is not None else 0,
        }


def _grants(budget: StepBudget, context: int) -> int:
    """Tokens `budget` would grant a prompt chunk after `context` (without spending them)."""
    return StepBudget(budget.seconds, budget.line, budget.tokens).take(PROBE_TOKENS, context)
