"""A worker's scheduler with its role plugged in: the one place that knows every role.

No role imports this module, so the roles and their factory form no import circle.
"""

from __future__ import annotations

from baton.common.cache.kv_pool import KVPool
from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.disagg.aggregated_role import Role
from baton.common.disagg.decode_role import DecodeRole
from baton.common.disagg.prefill_role import PrefillRole
from baton.common.engine.model_runner import ModelRunner
from baton.common.engine.scheduler import OutputSink, Scheduler


def _make_role(
    role: str,
    pool: KVPool,
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    transfer: TransferConfig | None,
) -> Role:
    if role == "both":
        return Role()
    transfer = transfer or TransferConfig()
    if role == "prefill":
        return PrefillRole(pool, model_cfg.num_kv_heads, transfer)
    if role == "decode":
        return DecodeRole(pool, model_cfg.num_kv_heads, transfer, cfg.tpot_slo)
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
        handler = _make_role(role, runner.pool, runner.cfg, model_cfg, transfer)
    except BaseException:
        runner.shutdown()
        raise
    scheduler = Scheduler(cfg, model_cfg, sink, runner=runner, hooks=handler)
    handler.bind(scheduler)
    return scheduler, handler


ROLES = ("prefill", "decode", "both")


def switch_role(
    scheduler: Scheduler,
    old: Role,
    old_name: str,
    role: str,
    model_cfg: ModelConfig,
    transfer: TransferConfig | None = None,
) -> tuple[Role, str]:
    """Plug `role` into the scheduler instead of `old`, which must hold no room while its
    scheduler holds no request (the caller waited; else ValueError, nothing changed). The
    old role's KV manager and threads shut down first (a fixed KV-control port is free
    again), then the new role starts. Returns the role plugged in now and '', or, when the
    new one could not start, the old role started again and why."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    if old.has_work() or scheduler.requests or scheduler.has_work():
        raise ValueError("requests or rooms are still on this worker")
    if scheduler.cfg.tp_size > 1 and "both" in (role, old_name):
        # The pool was sized with the wire buffer a transfer role needs, or without it.
        raise ValueError("with tensor parallelism only prefill <-> decode can change in place")
    old.shutdown()
    pool = scheduler.runner.pool
    try:
        handler, error = _make_role(role, pool, scheduler.cfg, model_cfg, transfer), ""
    except Exception as e:
        error = f"the {role} role did not start: {type(e).__name__}: {e}"
        handler = _make_role(old_name, pool, scheduler.cfg, model_cfg, transfer)
    scheduler.set_hooks(handler)
    handler.bind(scheduler)
    return handler, error
