"""How each step reaches the tensor-parallel followers (see `tp`).

Rank 0 broadcasts the step's host columns as they are (`step.StepColumns`, msgpack bytes in
a uint8 tensor: no Python objects), then its input ids, resolved on rank 0's device from
its future map, so followers need no sampler and no future map, and the broadcast needs no
host sync. A follower uploads the columns as rank 0 did (`StepColumns.upload`). The bytes
are decoded without a schema: both ends run the same code.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from baton.common.devices import to_device, upload
from baton.common.engine.step import Step, StepColumns


def _plain(obj: object) -> object:
    """msgpack takes no numpy arrays or ranges: a column holds both (`devices.Ints`)."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, range):
        return list(obj)
    raise NotImplementedError(type(obj))


_encoder = msgspec.msgpack.Encoder(enc_hook=_plain)


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


def step_message(step: Step, num_tokens: int) -> bytes:
    """What rank 0 broadcasts ahead of a step's input ids."""
    return _encoder.encode([num_tokens, step.columns, step.kv_scatter, step.kv_gather])


def read_step_message(data: bytes) -> tuple[int, StepColumns, list[int], list[int]] | None:
    """The number of input ids, the columns and the KV moves; None: rank 0 stops."""
    message = msgspec.msgpack.decode(data)
    if message is None:
        return None
    num_tokens, fields, kv_scatter, kv_gather = message
    return num_tokens, StepColumns(*fields), kv_scatter, kv_gather


def send_step(step: Step, ids: torch.Tensor) -> None:
    """Rank 0: tell the followers what this step computes (called before the forward).
    From the host columns the step was uploaded from: reading the device tensors back would
    wait for the step in flight."""
    broadcast_bytes(step_message(step, int(ids.numel())))
    dist.broadcast(ids.to(_comm_device()), src=0)


def stop_message() -> bytes:
    return _encoder.encode(None)


def send_stop() -> None:
    broadcast_bytes(stop_message())


def receive_step(
    device: torch.device, req_to_token: torch.Tensor
) -> tuple[Step, torch.Tensor] | None:
    """Followers: the next step and its input ids, or None when rank 0 stops."""
    message = read_step_message(broadcast_bytes(None))
    if message is None:
        return None
    num_tokens, columns, kv_scatter, kv_gather = message
    ids = torch.empty(num_tokens, dtype=torch.int64, device=_comm_device())
    dist.broadcast(ids, src=0)
    batch, logit_rows, _, _ = columns.upload(device, req_to_token)
    ids = ids.to(device)
    no_samples = torch.empty(0, dtype=torch.int64, device=device)
    step = Step(columns, ids, batch, logit_rows, no_samples)
    step.kv_scatter, step.kv_gather = kv_scatter, kv_gather
    return step, ids
