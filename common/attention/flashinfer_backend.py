"""Attention with flashinfer's paged kernels (CUDA only).

Planned once per step in `prepare` (page tables built from the req-to-token table by one
Triton kernel, `page_list.page_indices`) and reused by every layer. The KV pool's
per-layer view `[num_pages, 2, page_size, Hk, D]` is flashinfer's NHD paged layout; its page
stride spans all layers (page-major pool), which flashinfer reads through the tensor's
strides.

A prefill of prompts without a cached prefix attends with the ragged kernel to the k and v
the projection left in its output (`wants_new_kv`), not through the pool's page table: on
an H100 that kernel took 76 µs a layer for a 2,048-token prompt where the paged one took
106 (`benchmarks/lab/gpu_attention.py`, `results/gpu_2026-11-26_s07/`), and the step needs no
page table. The pool still receives those k and v for the decode steps after. A step of
one such prompt takes flashinfer's single-prompt kernel, which needs no plan: the ragged
plan was 0.45-0.9 ms of host work before a lone prompt's first kernel
(`benchmarks/lab/gpu_ttft.py`, `results/gpu_2026-11-27_s10/`).

CUDA graphs: `graph_wrapper(bs)` gives a decode wrapper with fixed index buffers for a
padded batch size; the runner plans it before each replay.
"""

from __future__ import annotations

import torch

from baton.common.attention.base import AttentionBackend, ForwardBatch, NewKV
from baton.common.attention.page_list import page_indices
from baton.common.cache.kv_pool import KVPool
from baton.common.devices import pinned

_WORKSPACE_BYTES = 256 * 1024 * 1024
SINGLE = object()  # the active "wrapper" of a step of one prompt without a cached prefix


def page_table(
    batch: ForwardBatch, page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's paged-KV table of `batch`: (indptr [B+1] int32 on the host, indices
    [pages] int32 on `device`, last_page_len [B] int32 on the host). One upload and one
    kernel launch (`page_indices`); no host loop over pages, no sync."""
    seq = torch.tensor(batch.seq_lens_list, dtype=torch.int32)
    counts = (seq + page_size - 1) // page_size
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    # pinned: flashinfer's plan uploads indptr and last, and the kernel reads indptr; from
    # pageable memory each copy would wait for the step in flight
    indptr = pinned(indptr)
    indices = page_indices(
        batch.req_to_token,
        batch.req_slots,
        indptr.to(device, non_blocking=True),
        int(indptr[-1]),  # a host tensor: no sync
        page_size,
    )
    last = seq - (counts - 1) * page_size
    return indptr, indices, pinned(last)


class FlashInferBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, head_dim)
        import flashinfer

        if pool.device.type != "cuda":
            raise RuntimeError("the flashinfer backend needs a CUDA device")
        self._fi = flashinfer
        dev = pool.device
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.group = num_heads // pool.num_kv_heads
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.group >= 4
        )
        self._graph_wrappers: dict[int, object] = {}
        self._graph_indices: torch.Tensor | None = None  # shared: one graph runs at a time
        self._active: object = self.decode_wrapper  # SINGLE: one prompt, no plan
        self._uploaded: dict[object, torch.cuda.Event] = {}  # wrapper -> its last plan's upload

    def _plan(self, wrapper: object, *args: object, **kwargs: object) -> None:
        """`wrapper.plan`, once the wrapper's previous plan has reached the device. plan
        writes its schedule into the wrapper's own pinned host buffer and queues an upload
        from it behind the step in flight; the scheduler plans the next step while this one
        runs, so the previous upload may not have read the buffer yet. It almost always
        has: the wait is for correctness, not for time."""
        uploaded = self._uploaded.get(wrapper)
        if uploaded is not None:
            uploaded.synchronize()
        wrapper.plan(*args, **kwargs)  # type: ignore[attr-defined]
        uploaded = torch.cuda.Event()
        uploaded.record()
        self._uploaded[wrapper] = uploaded

    def _plan_decode(self, wrapper: object, batch: ForwardBatch) -> None:
        indptr, indices, last = page_table(batch, self.pool.page_size, self.pool.device)
        dtype = self.pool.dtype
        self._plan(
            wrapper,
            indptr,
            indices,
            last,
            self.num_heads,
            self.pool.num_kv_heads,
            self.head_dim,
            self.pool.page_size,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=self.scale,
        )

    def reads_table(self, batch: ForwardBatch) -> bool:
        """Only the ragged prefill (no cached prefix anywhere in the step) does not."""
        return batch.is_decode or any(batch.prefix_lens_list)

    @property
    def wants_new_kv(self) -> bool:  # type: ignore[override]
        return self._active is self.ragged_wrapper or self._active is SINGLE

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            self._plan_decode(self.decode_wrapper, batch)
            self._active = self.decode_wrapper
            return
        if batch.batch_size == 1 and not self.reads_table(batch):
            self.prepare_single_prompt()
            return
        qo = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        qo[1:] = torch.tensor(batch.extend_lens_list, dtype=torch.int32).cumsum(0)
        qo = pinned(qo)
        dtype = self.pool.dtype
        if not self.reads_table(batch):  # every query attends only to its own step
            self._plan(
                self.ragged_wrapper,
                qo,
                qo,
                self.num_heads,
                self.pool.num_kv_heads,
                self.head_dim,
                causal=True,
                sm_scale=self.scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            self._active = self.ragged_wrapper
            return
        indptr, indices, last = page_table(batch, self.pool.page_size, self.pool.device)
        self._plan(
            self.prefill_wrapper,
            qo,
            indptr,
            indices,
            last,
            self.num_heads,
            self.pool.num_kv_heads,
            self.head_dim,
            self.pool.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        self._active = self.prefill_wrapper

    def attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        dtype = self.pool.dtype
        if self.wants_new_kv:
            if new_kv is None:
                raise RuntimeError("a ragged prefill needs this step's k and v")
            k, v = new_kv
            if self._active is SINGLE:
                return self._fi.single_prefill_with_kv_cache(
                    q.to(dtype), k.to(dtype), v.to(dtype), causal=True, sm_scale=self.scale
                )
            return self.ragged_wrapper.run(q.to(dtype), k.to(dtype), v.to(dtype))
        return self._active.run(q.to(dtype), self.pool.layer_kv(layer))  # type: ignore[attr-defined]

    # -- CUDA graphs -------------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return True

    def prepare_single_prompt(self) -> bool:
        """flashinfer's single-prompt kernel: no plan, no table; q, k and v as given."""
        self._active = SINGLE
        return True

    def prepare_graph(self, bs: int, batch: ForwardBatch, max_pages: int) -> None:
        """Plan the fixed-buffer decode wrapper of padded batch size `bs` for `batch`.
        `max_pages`: the page-index capacity of the largest graph (see
        `cuda_graph.graph_page_capacity`); every graph shares that one buffer."""
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            dev = self.pool.device
            if self._graph_indices is None or self._graph_indices.numel() < max_pages:
                self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=dev)
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.group >= 4,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=dev),
            )
            self._graph_wrappers[bs] = wrapper
        self._plan_decode(wrapper, batch)
        self._active = wrapper
