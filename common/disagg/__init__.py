"""Roles: how a worker's scheduler process takes requests in.

The aggregated worker (`both`) hands each request straight to the scheduler. The prefill
role holds a request in its bootstrap queue until the decode side has sent its page
indices; the decode role reserves pages and waits for the KV to arrive before the request
joins the running batch. Every role drives the same scheduler loop, through the seam of
`baton.common.engine.seam`: hooks given when the scheduler is built, and a narrow port.
"""

from __future__ import annotations

from baton.common.cache.kv_pool import KVPool
from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.engine.model_runner import ModelRunner
from baton.common.engine.scheduler import OutputSink, Scheduler
from baton.common.engine.seam import SchedulerHooks, SchedulerPort
from baton.common.protocol import GenerateReq


class Role(SchedulerHooks):
    """The aggregated worker: no KV transfer, requests go straight to the scheduler."""

    kv_control_address = ""
    transfer_address = ""
    port: SchedulerPort

    def bind(self, port: SchedulerPort) -> None:
        self.port = port

    def on_generate(self, msg: GenerateReq) -> None:
        req = self.port.new_request(msg.rid, msg.input_ids, msg.sampling)
        if not req.finished:
            self.port.enqueue(req)

    def on_abort(self, rid: str) -> None:
        self.port.abort(rid)

    def on_peer_lost(self, kv_control_address: str) -> None:
        """A peer's lease lapsed (roles with KV transfer fail its rooms)."""

    def poll(self) -> None:
        """Advance the role's queues (called every loop iteration)."""

    def has_work(self) -> bool:
        return False

    def stats(self) -> dict[str, float]:
        return {}

    def fail_all(self, reason: str) -> None:
        self.port.fail_all(reason)

    def shutdown(self) -> None:
        pass


def _make_role(
    role: str, pool: KVPool, model_cfg: ModelConfig, transfer: TransferConfig | None
) -> Role:
    if role == "both":
        return Role()
    transfer = transfer or TransferConfig()
    if role == "prefill":
        from baton.common.disagg.prefill import PrefillRole

        return PrefillRole(pool, model_cfg.num_kv_heads, transfer)
    if role == "decode":
        from baton.common.disagg.decode import DecodeRole

        return DecodeRole(pool, model_cfg.num_kv_heads, transfer)
    raise ValueError(f"unknown role {role!r}")


def start_role(
    role: str,
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    sink: OutputSink,
    transfer: TransferConfig | None = None,
) -> tuple[Scheduler, Role]:
    """A scheduler with `role` plugged in: the model runner first (the role's KV manager
    needs its pool), then the role, then the scheduler built with the role's hooks."""
    runner = ModelRunner(cfg, model_cfg)
    try:
        handler = _make_role(role, runner.pool, model_cfg, transfer)
    except BaseException:
        runner.shutdown()
        raise
    scheduler = Scheduler(cfg, model_cfg, sink, runner=runner, hooks=handler)
    handler.bind(scheduler)
    return scheduler, handler
