"""The aggregated role, and what every role does unless it says otherwise.

The aggregated worker (`baton worker`) has no KV transfer: each request goes straight to
the scheduler. The prefill and decode roles (`prefill_role.py`, `decode_role.py`) derive
from it through `transfer_role.TransferRole` and override what transfer changes.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from baton.common.engine.seam import SchedulerHooks, SchedulerPort
from baton.common.protocol import GenerateReq, MigrateReq, PeerInfo, SpansOut
from baton.common.state import Req, RequestSpans

log = logging.getLogger(__name__)


class Role(SchedulerHooks):
    """The aggregated worker: no KV transfer, requests go straight to the scheduler."""

    kv_control_address = ""
    transfer_address = ""
    port: SchedulerPort

    def bind(self, port: SchedulerPort) -> None:
        self.port = port

    def on_generate(self, msg: GenerateReq) -> None:
        req = self.port.new_request(msg.rid, msg.input_ids, msg.sampling, msg.received_at)
        if not req.finished:
            trace(req, msg)
            self.port.enqueue(req)

    def on_abort(self, rid: str) -> None:
        self.port.abort(rid)

    def on_migrate(self, msg: MigrateReq) -> str | None:
        """Take request `msg.rid` to hand off; why not, if refused. Live migration is a
        decode worker's (the frontend refuses it elsewhere)."""
        log.warning("request %s: live migration refused: not a decode worker", msg.rid)
        return "not a decode worker"

    def connect(self, peer: PeerInfo) -> Future[None] | None:
        """Open the KV data connections to decode worker `peer` ahead of a live migration
        to it (`ConnectReq`), without waiting; None: this role hands nothing off."""
        return None

    def on_peer_lost(self, kv_control_address: str) -> None:
        """A peer's lease lapsed (roles with KV transfer fail its rooms)."""

    def poll(self) -> None:
        """Advance the role's queues (called every loop iteration)."""

    def has_work(self) -> bool:
        return False

    def stats(self) -> dict[str, float]:
        return {}

    def take_spans(self) -> list[SpansOut] | None:
        """Spans of traced requests that ended before them (P's KV transfer), if any."""
        return None

    def fail_all(self, reason: str) -> None:
        self.port.fail_all(reason)

    def shutdown(self) -> None:
        pass


def trace(req: Req, msg: GenerateReq) -> None:
    """Record `req`'s spans if its worker traces it."""
    if msg.traceparent is not None:
        req.trace = RequestSpans(msg.traceparent)
