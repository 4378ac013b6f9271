"""flashinfer's page list built by one Triton kernel (`page_indices`), run by the Triton
interpreter on the CPU, against the torch reference and the pages each request was given.

Each case gives every request pages of its own in shuffled order, on shuffled rows of the
req-to-token table; slots past a request's length hold -1, so a read beyond its pages would
show. flashinfer itself is not needed: the kernel is the page table's only device work.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.interpreted import import_triton, interpreted

if (reason := import_triton()) is not None:
    pytest.skip(f"triton cannot be imported ({reason})", allow_module_level=True)

from baton.common.attention import page_list as kernels
from baton.common.attention.base import ForwardBatch
from baton.common.attention.flashinfer_backend import page_table


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> Iterator[None]:
    with interpreted(kernels.__name__):
        yield


def make_table(
    seq_lens: list[int], page_size: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(req_to_token, req_slots, indptr, the pages given to the requests, in order)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-s // page_size) for s in seq_lens]
    free_pages = (torch.randperm(sum(counts) + 7, generator=gen) + 5).tolist()
    batch = len(seq_lens)
    table = torch.full((batch + 2, max(seq_lens) + 9), -1, dtype=dtype)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    given: list[int] = []
    for row, seq, count in zip(slots.tolist(), seq_lens, counts, strict=True):
        pages = [free_pages.pop() for _ in range(count)]
        offsets = torch.arange(seq)
        table[row, :seq] = (
            torch.tensor(pages)[offsets // page_size] * page_size + offsets % page_size
        ).to(dtype)
        given += pages
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(counts).cumsum(0)
    return table, slots, indptr, given


def check(
    table: torch.Tensor, slots: torch.Tensor, indptr: torch.Tensor, given: list[int], page_size: int
) -> None:
    assert kernels.interpreting(), "without the interpreter the reference meets itself"
    num_pages = int(indptr[-1])
    got = kernels.page_indices(table, slots, indptr, num_pages, page_size)
    expected = kernels.page_indices_reference(table, slots, indptr, num_pages, page_size)
    assert got.dtype == expected.dtype == torch.int32
    assert got.tolist() == expected.tolist() == given


# batch 1 and 5: one token, exactly one page, one page and a token, a long context (several
# kernel blocks of 512 pages at page size 1), and a short one behind it
BATCHES = {"one": [3000], "five": [1, 16, 17, 3000, 5]}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("page_size", [1, 16, 3])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_matches_reference(batch: str, page_size: int, dtype: torch.dtype) -> None:
    seq_lens = list(BATCHES[batch])
    if batch == "five":  # exactly one page and one past it, at this page size
        seq_lens[1:3] = [page_size, page_size + 1]
    table, slots, indptr, given = make_table(seq_lens, page_size, dtype)
    check(table, slots, indptr, given, page_size)


def test_column_strided_table() -> None:
    """A table whose columns are not adjacent in memory is read through its strides."""
    table, slots, indptr, given = make_table([40, 7, 1], 3, torch.int64, seed=1)
    strided = table.t().contiguous().t()
    assert strided.stride(1) != 1
    check(strided, slots, indptr, given, 3)


def test_flashinfer_page_table() -> None:
    """What flashinfer's plan gets for a decode step: indptr and last-page lengths on the
    host, the pages on the device, all int32."""
    seq_lens = [1, 16, 17, 40]
    table, slots, _, given = make_table(seq_lens, 16, torch.int64, seed=2)
    ones = torch.ones(len(seq_lens), dtype=torch.int64)
    batch = ForwardBatch(
        positions=torch.tensor(seq_lens) - 1,
        out_cache_loc=ones,
        req_slots=slots,
        seq_lens=torch.tensor(seq_lens),
        extend_lens=ones,
        prefix_lens=torch.tensor(seq_lens) - 1,
        req_to_token=table,
        seq_lens_list=seq_lens,
        extend_lens_list=[1] * len(seq_lens),
        prefix_lens_list=[s - 1 for s in seq_lens],
    )
    indptr, indices, last = page_table(batch, 16, table.device)
    assert [t.dtype for t in (indptr, indices, last)] == [torch.int32] * 3
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert last.tolist() == [1, 16, 1, 8]
    assert indices.tolist() == given
