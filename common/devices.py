"""Moving host data to the device without stalling the step in flight.

A copy from pageable host memory to the GPU makes the host wait until every kernel
queued before it has run, so preparing step N+1 would wait for step N to finish and
overlap would be lost. These helpers go through pinned memory and copy asynchronously.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def to_device(
    lists: Sequence[Sequence[int]] | Sequence[Sequence[float]],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> list[torch.Tensor]:
    """Tensors of `dtype` on `device` from host lists, in one (asynchronous, on CUDA) copy."""
    sizes = [len(values) for values in lists]
    flat = upload(host_array(chain.from_iterable(lists), sum(sizes), dtype), device)
    return list(flat.split(sizes))


def host_array(values: Iterable[int] | Iterable[float], n: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of the `n` `values` (through numpy: a few times faster than
    `torch.tensor` on a list, which checks every element's type; a prefill's step builds
    thousands)."""
    return torch.from_numpy(np.fromiter(values, dtype=_NUMPY[dtype], count=n))


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: through pinned memory, asynchronously, on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory when CUDA is present (for asynchronous uploads)."""
    return t.pin_memory() if torch.cuda.is_available() else t


# -- host memory that same-host peers can map ------------------------------------------------
_SHARED: dict[int, int] = {}  # data_ptr -> memfd, while the memory lives


def shared_host_zeros(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor in a memfd (Linux), which processes of the same host can
    map through /proc/<pid>/fd (the KV transfer's `ipc` backend does). The memory goes
    with the process: nothing is left behind in /dev/shm. Elsewhere: plain zeros."""
    import mmap
    import os

    if not hasattr(os, "memfd_create") or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8)
    import weakref

    fd = os.memfd_create("baton-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)  # keeps `mapping`
    ptr = tensor.data_ptr()
    _SHARED[ptr] = fd

    def forget() -> None:
        _SHARED.pop(ptr, None)
        os.close(fd)

    weakref.finalize(mapping, forget)  # when the last tensor over it is gone
    return tensor


def shared_host_fd(tensor: torch.Tensor) -> int | None:
    """The memfd holding `tensor`, if it is one of `shared_host_zeros`'."""
    return _SHARED.get(tensor.data_ptr())
