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
