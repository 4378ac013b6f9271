"""Moving host data to the device without stalling the step in flight.

A copy from pageable host memory to the GPU makes the host wait until every kernel
queued before it has run, so preparing step N+1 would wait for step N to finish and
overlap would be lost. These helpers go through pinned memory and copy asynchronously.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


Ints = Sequence[int] | np.ndarray  # a list or range of integers, or a numpy array of them
BULK = 64  # a list at least this long converts alone; shorter ones are chained together


def to_device(
    columns: Sequence[Ints] | Sequence[Sequence[float]],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> list[torch.Tensor]:
    """Tensors of `dtype` on `device` from host columns, in one (asynchronous, on CUDA)
    copy."""
    sizes = [len(values) for values in columns]
    flat = upload(torch.from_numpy(flat_array(columns, dtype)), device)
    return list(flat.split(sizes))


def flat_array(parts: Sequence[Ints] | Sequence[Sequence[float]], dtype: torch.dtype) -> np.ndarray:
    """One numpy array of the values of `parts`, in order. Numpy arrays go in whole, long
    ranges and lists one by one, runs of short ones chained through `np.fromiter` (a
    prompt's step holds a few columns of thousands of values, a decode step many lists of
    one; numpy is a few times faster than `torch.tensor` on a list, which checks every
    element's type, and chaining long lists costs twice as much per value)."""
    np_dtype = _NUMPY[dtype]
    arrays: list[np.ndarray] = []
    run: list[Sequence[int] | Sequence[float]] = []

    def close_run() -> None:
        if run:
            n = sum(len(values) for values in run)
            arrays.append(np.fromiter(chain.from_iterable(run), dtype=np_dtype, count=n))
            run.clear()

    for values in parts:
        if isinstance(values, np.ndarray):
            close_run()
            arrays.append(values)
        elif len(values) < BULK:
            run.append(values)
        elif isinstance(values, range):
            close_run()
            arrays.append(np.arange(values.start, values.stop, values.step, dtype=np_dtype))
        else:
            close_run()
            arrays.append(np.fromiter(values, dtype=np_dtype, count=len(values)))
    close_run()
    return np.concatenate(arrays, dtype=np_dtype) if arrays else np.empty(0, np_dtype)


def as_list(values: Ints) -> list[int]:
    """`values` as a list (for a message: msgpack takes no numpy arrays)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: through pinned memory, asynchronously, on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory when CUDA is present (for asynchronous uploads)."""
    return t.pin_memory() if torch.cuda.is_available() else t


# -- host memory registered with CUDA ---------------------------------------------------------
def cuda_host_register(ptr: int, nbytes: int, flags: int = 0) -> str:
    """Register host memory with CUDA (pinned: copies to and from it are queued, not waited
    for). Returns '' or why it failed. A failed registration must not outlive this call:
    CUDA keeps the error as the thread's last one, and torch's next launch check on this
    thread would report it as that kernel's or copy's failure (a KV transfer failed so on
    an H200), so it is read and dropped here."""
    return _runtime_call("cudaHostRegister", ptr, nbytes, flags)


def cuda_host_unregister(ptr: int) -> str:
    """Undo `cuda_host_register`: '' or why it failed, the failure dropped likewise (an
    unregistering finalizer runs on whichever thread collects its owner: a forward thread's
    next kernel would report the failure as its own)."""
    return _runtime_call("cudaHostUnregister", ptr)


def _runtime_call(name: str, *args: int) -> str:
    """torch's binding of the CUDA runtime's `name`: '' or why it failed, the failure
    taken off the thread's last error."""
    cudart = torch.cuda.cudart()
    try:
        code = getattr(cudart, name)(*args)
    except (AttributeError, RuntimeError) as exc:
        return str(exc)
    if code == cudart.cudaError.success:
        return ""
    take_cuda_error()
    return cudart.cudaGetErrorString(code)


def take_cuda_error() -> str:
    """The calling thread's last CUDA error, cleared (cudaGetLastError, which torch does
    not bind, on the runtime torch loaded): '' where there is none or no runtime is loaded."""
    lib = _cudart_lib()
    if lib is None:
        return ""
    code = lib.cudaGetLastError()
    if code == 0:
        return ""
    return f"{code}: {lib.cudaGetErrorString(code).decode(errors='replace')}"


@functools.cache
def _cudart_lib() -> ctypes.CDLL | None:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:  # only one already loaded (RTLD_NOLOAD): torch's, never a second copy
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


# -- host memory that same-host peers can map ------------------------------------------------
_SHARED: dict[int, int] = {}  # data_ptr -> memfd, while the memory lives


def shared_host_zeros(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor in a memfd (Linux), which processes of the same host can
    map through /proc/<pid>/fd (the KV transfer's `ipc` backend does). The memory goes
    with the process: nothing is left behind in /dev/shm. Elsewhere: plain zeros."""
    import mmap

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
