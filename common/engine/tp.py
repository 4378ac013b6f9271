"""Tensor parallelism across scheduler processes: rank 0 schedules, every rank computes.

Rank 0 runs the whole scheduler; ranks 1..N-1 (followers) hold their shard of the weights
and of the KV pool and replay each step rank 0 broadcasts: first a small msgspec header
(positions, KV slots, table writes...), then the step's input ids, resolved on rank 0's
device from its future map — so followers need no sampler and no future map, and the
broadcast needs no host sync. Collectives inside the model (all-reduce, all-gather) keep
the ranks in lockstep. The header is msgspec bytes in a uint8 tensor (no Python objects).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from baton.common.attention.base import ForwardBatch
from baton.common.config import EngineConfig, ModelConfig
from baton.common.devices import as_list, to_device, upload
from baton.common.distributed import init_tp, leave_tp, tp

if TYPE_CHECKING:
    from baton.common.engine.model_runner import ModelRunner, StepInputs

log = logging.getLogger(__name__)


class StepHeader(msgspec.Struct, array_like=True):
    stop: bool = False
    num_tokens: int = 0
    positions: list[int] = []
    out_cache_loc: list[int] = []
    req_slots: list[int] = []
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    prefix_lens: list[int] = []
    logit_rows: list[int] = []
    table_writes: list[tuple[int, int, list[int]]] = []
    kv_scatter: list[int] = []
    kv_gather: list[int] = []


_decoder = msgspec.msgpack.Decoder(StepHeader)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def _comm_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0 sends `data`; every rank returns it. Rank 0 knows the size and the bytes on
    the host and uploads them asynchronously, so it never waits for the step in flight."""
    dev = _comm_device()
    if data is not None:
        (size,) = to_device([[len(data)]], dev)
        dist.broadcast(size, src=0)
        dist.broadcast(upload(torch.frombuffer(bytearray(data), dtype=torch.uint8), dev), src=0)
        return data
    size = torch.empty(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().numpy())


def send_step(inputs: StepInputs, ids: torch.Tensor) -> None:
    """Rank 0: tell the followers what this step computes (called before the forward).
    The header comes from the host lists the step was prepared from: reading the device
    tensors back would wait for the step in flight."""
    b = inputs.batch
    positions, out_cache_loc, req_slots, logit_rows = inputs.host_lists
    header = StepHeader(
        num_tokens=int(ids.numel()),
        positions=as_list(positions),
        out_cache_loc=as_list(out_cache_loc),
        req_slots=req_slots,
        seq_lens=b.seq_lens_list,
        extend_lens=b.extend_lens_list,
        prefix_lens=b.prefix_lens_list,
        logit_rows=logit_rows,
        table_writes=[(row, start, as_list(slots)) for row, start, slots in inputs.table_writes],
        kv_scatter=inputs.kv_scatter,
        kv_gather=inputs.kv_gather,
    )
    broadcast_bytes(msgspec.msgpack.encode(header))
    comm = ids.to(_comm_device())
    dist.broadcast(comm, src=0)


def send_stop() -> None:
    broadcast_bytes(msgspec.msgpack.encode(StepHeader(stop=True)))


def receive_step(runner: ModelRunner) -> tuple[StepInputs, torch.Tensor] | None:
    """Followers: the next step, or None when rank 0 stops."""
    from baton.common.engine.model_runner import StepInputs

    header = _decoder.decode(broadcast_bytes(None))
    if header.stop:
        return None
    ids = torch.empty(header.num_tokens, dtype=torch.int64, device=_comm_device())
    dist.broadcast(ids, src=0)
    positions, out_cache_loc, req_slots, seq_lens, extend_lens, prefix_lens, logit_rows = to_device(
        [
            header.positions,
            header.out_cache_loc,
            header.req_slots,
            header.seq_lens,
            header.extend_lens,
            header.prefix_lens,
            header.logit_rows,
        ],
        runner.device,
    )
    batch = ForwardBatch(
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_slots=req_slots,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        req_to_token=runner.table.table,
        seq_lens_list=header.seq_lens,
        extend_lens_list=header.extend_lens,
        prefix_lens_list=header.prefix_lens,
    )
    dev = runner.device
    inputs = StepInputs(
        input_ids=ids.to(dev),
        batch=batch,
        logit_rows=logit_rows,
        rows=[],
        future_out=torch.empty(0, dtype=torch.int64, device=dev),
        table_writes=header.table_writes,
        kv_scatter=header.kv_scatter,
        kv_gather=header.kv_gather,
    )
    return inputs, ids.to(dev)


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
        step = receive_step(runner)
        if step is None:
            break
        inputs, ids = step
        runner.forward(inputs, ids)
    dist.destroy_process_group()
