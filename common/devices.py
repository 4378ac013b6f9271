"""Moving host data to the device without stalling the step in flight.

A copy from pageable host memory to the GPU makes the host wait until every kernel
queued before it has run, so preparing step N+1 would wait for step N to finish and
overlap would be lost. These helpers go through pinned memory and copy asynchronously.
"""

from __future__ import annotations

import torch


def to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device` from host lists, in one (asynchronous, on CUDA) copy."""
    flat = torch.tensor([x for values in lists for x in values], dtype=torch.int64)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([len(values) for values in lists]))


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory when CUDA is present (for asynchronous uploads)."""
    return t.pin_memory() if torch.cuda.is_available() else t
