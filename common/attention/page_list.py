"""flashinfer's paged-KV page list from the req-to-token table (`page_indices`): one Triton
program per request, so that building it each step is one launch rather than a chain of
small torch ops (host time per decode step), and nothing is read back to the host. Not
attention but its bookkeeping; the torch reference is the CPU path and the test oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.common.attention.triton_kernels import interpreting


@triton.jit
def _page_indices_kernel(
    indices_ptr, req_to_token_ptr, req_slots_ptr, indptr_ptr,
    stride_rt, stride_rc, page_size, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    start = tl.load(indptr_ptr + b)
    count = tl.load(indptr_ptr + b + 1) - start
    row_ptr = req_to_token_ptr + tl.load(req_slots_ptr + b).to(tl.int64) * stride_rt
    for j0 in range(0, count, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        mask = j < count
        # a page's first slot names the page: slots are page * page_size + offset, all >= 0,
        # so the kernel's truncating division agrees with torch's floor division
        slot = tl.load(row_ptr + j.to(tl.int64) * page_size * stride_rc, mask=mask, other=0)
        tl.store(indices_ptr + start + j, (slot // page_size).to(tl.int32), mask=mask)


def page_indices(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    indptr: torch.Tensor,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """Every request's pages, flattened: `indices[indptr[b] + j]` is the page holding token
    `j * page_size` of request b (row `req_slots[b]` of `req_to_token`), for j below
    `indptr[b + 1] - indptr[b]`; int32, on req_to_token's device. `indptr` [B+1] lives there
    too; `num_pages` is `indptr[-1]`, passed from the host so that nothing waits on the device.
    CPU tensors take the torch path unless the Triton interpreter is on."""
    if not req_to_token.is_cuda and not interpreting():
        return page_indices_reference(req_to_token, req_slots, indptr, num_pages, page_size)
    indices = torch.empty(num_pages, dtype=torch.int32, device=req_to_token.device)
    if num_pages > 0:
        _page_indices_kernel[(req_slots.shape[0],)](
            indices, req_to_token, req_slots, indptr,
            req_to_token.stride(0), req_to_token.stride(1), page_size, BLOCK=512,
        )  # fmt: skip
    return indices


def page_indices_reference(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    indptr: torch.Tensor,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """`page_indices` in torch ops (no host sync either): the path for CPU tensors and the
    kernel's test oracle."""
    dev = req_to_token.device
    counts = (indptr[1:] - indptr[:-1]).to(torch.int64)
    requests = torch.arange(len(counts), device=dev)
    rows = torch.repeat_interleave(requests, counts, output_size=num_pages)
    cols = (torch.arange(num_pages, device=dev) - indptr[rows]) * page_size
    return (req_to_token[req_slots[rows], cols] // page_size).to(torch.int32)
