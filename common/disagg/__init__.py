"""Role handlers: how a worker's scheduler process takes requests in, by role.

The aggregated worker (`both`) hands each request straight to the scheduler. The prefill
role holds a request in its bootstrap queue until the decode side has sent its page
indices; the decode role preallocates pages and waits for the KV to arrive before the
request joins the running batch. Every role drives the same scheduler loop.
"""

from __future__ import annotations

from baton.common.config import TransferConfig
from baton.common.engine.req import FinishReason
from baton.common.engine.scheduler import Scheduler
from baton.common.protocol import GenerateReq


class RoleHandler:
    """The aggregated worker: no KV transfer, requests go straight to the scheduler."""

    kv_control_address = ""
    transfer_address = ""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def on_generate(self, msg: GenerateReq) -> None:
        self.scheduler.add_request(msg.rid, msg.input_ids, msg.sampling)

    def on_abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def on_peer_lost(self, kv_control_address: str) -> None:
        """A peer's lease lapsed (roles with KV transfer fail its rooms)."""

    def poll(self) -> None:
        """Advance the role's queues (called every loop iteration)."""

    def has_work(self) -> bool:
        return False

    def stats(self) -> dict[str, float]:
        return {}

    def fail_all(self, reason: str) -> None:
        for req in list(self.scheduler.requests.values()):
            req.error = reason
            self.scheduler.finish(req, FinishReason.ERROR)

    def shutdown(self) -> None:
        pass


def make_role_handler(role: str, scheduler: Scheduler, transfer: TransferConfig) -> RoleHandler:
    if role == "both":
        return RoleHandler(scheduler)
    if role == "prefill":
        from baton.common.disagg.prefill import PrefillHandler

        return PrefillHandler(scheduler, transfer)
    if role == "decode":
        from baton.common.disagg.decode import DecodeHandler

        return DecodeHandler(scheduler, transfer)
    raise ValueError(f"unknown role {role!r}")
