"""Helpers for tests and benchmarks of the KV transfer: buffers, manager pairs, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from baton.common.devices import shared_host_zeros
from baton.common.transfer.base import KVArgs, KVPoll, KVRoomHandle
from baton.common.transfer.manager import TransferManager
from baton.common.transfer.registry import make_backend


def kv_buffer(
    num_pages: int,
    page_size: int,
    layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    seed: int | None = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, int]:
    """A page-major KV pool ``[pages, layers, 2, page_size, kv_heads, head_dim]`` filled
    with random bytes (zeros when ``seed`` is None), and its page size in bytes."""
    shape = (num_pages, layers, 2, page_size, kv_heads, head_dim)
    if device == "cpu":  # in a memfd, as a worker's pool is: the ipc backend can map it
        nbytes = num_pages * layers * 2 * page_size * kv_heads * head_dim * dtype.itemsize
        buffer = shared_host_zeros(nbytes).view(dtype).view(shape)
    else:
        buffer = torch.zeros(shape, dtype=dtype, device=device)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (buffer.numel() * buffer.element_size(),), generator=generator)
        buffer.view(-1).view(torch.uint8).copy_(raw.to(torch.uint8))
    return buffer, buffer[0].numel() * buffer.element_size()


def backend_unusable(name: str) -> str | None:
    """Why backend ``name`` cannot run here (a skip reason), or None."""
    try:
        backend = make_backend(name)
        buffer, page_bytes = kv_buffer(1, 1, seed=None)
        backend.start(KVArgs(buffer, page_bytes, 1), None)
        backend.shutdown()
    except Exception as exc:
        return f"{name} backend unusable here: {exc}"
    return None


@contextmanager
def manager_pair(
    backend: str,
    src: torch.Tensor,
    dst: torch.Tensor,
    page_bytes: int,
    sender_args: dict[str, Any] | None = None,
    **args: Any,
) -> Iterator[tuple[TransferManager, TransferManager]]:
    """A prefill manager over ``src`` and a decode manager over ``dst``, shut down after.
    ``args`` go to both KVArgs; ``sender_args`` override the prefill side's."""
    base = KVArgs(src, page_bytes, src.shape[0], **args)
    prefill = TransferManager(replace(base, **(sender_args or {})), "prefill", backend)
    try:
        decode = TransferManager(
            replace(base, buffer=dst, num_pages=dst.shape[0]), "decode", backend
        )
    except BaseException:
        prefill.shutdown()
        raise
    try:
        yield prefill, decode
    finally:
        prefill.shutdown()
        decode.shutdown()


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds; returns its last value."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def wait_terminal(handles: Iterable[KVRoomHandle], timeout: float = 10.0) -> list[KVPoll]:
    """Poll every handle until all are terminal (or timeout); returns their states."""
    handles = list(handles)
    wait_for(lambda: all(h.poll().terminal for h in handles), timeout)
    return [h.poll() for h in handles]
