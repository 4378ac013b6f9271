"""Tensor parallelism across scheduler processes: rank 0 schedules, every rank computes.

Rank 0 runs the whole scheduler; ranks 1..N-1 (followers) hold their shard of the weights
and of the KV pool and replay each step rank 0 broadcasts (`tp_step`): the step's host
columns, then its input ids. Collectives inside the model (all-reduce, all-gather) keep
the ranks in lockstep. This module starts and stops the group and runs the followers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket

import torch
import torch.distributed as dist

from baton.common.config import EngineConfig, ModelConfig
from baton.common.distributed import init_tp, leave_tp, tp
from baton.common.engine.tp_step import receive_step, send_stop

log = logging.getLogger(__name__)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_followers(cfg: EngineConfig, model_cfg: ModelConfig) -> list[mp.process.BaseProcess]:
    """The process entry point, as rank 0: start the followers (none without TP)."""
    if cfg.tp_size == 1:
        return []
    if model_cfg.num_kv_heads % cfg.tp_size or model_cfg.num_heads % cfg.tp_size:
        raise ValueError(
            f"tp_size {cfg.tp_size} must divide the model's {model_cfg.num_heads} "
            f"attention heads and {model_cfg.num_kv_heads} KV heads"
        )
    return start_group(cfg)


def stop_followers(procs: list[mp.process.BaseProcess]) -> None:
    """Rank 0, after its last step: stop the followers and leave the group."""
    if not procs:
        return
    send_stop()
    for p in procs:
        p.join(timeout=30)
    leave_tp()


def start_group(cfg: EngineConfig) -> list[mp.process.BaseProcess]:
    """Rank 0: start the followers and join the group with them."""
    init_method = free_init_method()
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = [
        ctx.Process(
            target=follower_main, args=(cfg, rank, init_method), daemon=True, name=f"baton-tp{rank}"
        )
        for rank in range(1, cfg.tp_size)
    ]
    for p in procs:
        p.start()
    init_tp(0, cfg.tp_size, init_method, backend_for(cfg.device))
    return procs


def follower_main(cfg: EngineConfig, rank: int, init_method: str) -> None:
    import dataclasses

    from baton.common.engine.model_runner import ModelRunner
    from baton.common.engine.process import freeze_heap

    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s tp{rank}: %(message)s")
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    init_tp(rank, cfg.tp_size, init_method, backend_for(cfg.device))
    cfg = dataclasses.replace(cfg, device=rank_device(cfg.device, rank))
    runner = ModelRunner(cfg, ModelConfig.from_pretrained(cfg.model_path))
    if runner.reserved_pages:
        runner.capture_cuda_graphs(scratch_row=runner.table.alloc())
    log.info("tensor-parallel rank %d of %d ready", rank, tp().size)
    freeze_heap()
    while True:
        received = receive_step(runner.device, runner.table.table)
        if received is None:
            break
        step, ids = received
        runner.forward(step, ids)
    dist.destroy_process_group()
