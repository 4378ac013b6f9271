"""CUDA graphs for a step of one prompt without a cached prefix, captured for padded lengths.

A short prompt's forward is bound by the host: launching its kernels one by one (about
nine a layer, each through Python) took 18-24 ms on an H200 while the GPU needed 5.4 ms
for 128 tokens and 10.7 ms for 512 (2026-11-27, `benchmarks/results/gpu_2026-11-27_s11`).
A step that computes one prompt of at most `max_tokens` tokens, reads no cached prefix and
wants the logits of its last row only (or of none) replays the graph of the smallest
captured length >= its own instead:

- the padding rows come after the prompt's, so causal attention keeps them out of the
  prompt's rows; rows are independent everywhere else;
- they take position 0 and write their KV into the scratch page the allocator never hands
  out, as a decode graph's padding rows do;
- the graph ends with the logits of one row, `logit_row`; only the last layer's attention
  output of that row goes on through o_proj and the MLP (`CausalLM.forward`).

The attention backend attends as for one prompt without a plan (`prepare_single_prompt`):
its kernel's arguments are fixed at capture, which the padded length makes right.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from baton.common.attention.base import AttentionBackend, ForwardBatch
from baton.common.engine.cuda_graph import capture_graph

log = logging.getLogger(__name__)

_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
_SIZES_LONG = (1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Padded prompt lengths captured up to `max_tokens` (a padded length wastes at most
    a third of its rows past 48 tokens)."""
    return [s for s in (*_SIZES, *_SIZES_LONG) if s <= max_tokens]


class TokenRows:
    """A graph's fixed input rows for up to `n` tokens: ids, positions and KV slots, rows
    of one buffer. The padding past a step's tokens takes token 0 at position 0 and writes
    its KV into the scratch slot, reset before every replay (a longer step left its slots
    there)."""

    def __init__(self, n: int, scratch_slot: int, device: torch.device) -> None:
        self.meta = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.meta[2].fill_(scratch_slot)
        self.pad = torch.tensor([[0], [0], [scratch_slot]], dtype=torch.int64, device=device)

    def fill(self, input_ids: torch.Tensor, batch: ForwardBatch, sizes: list[int]) -> int:
        """The step's tokens, then padding up to the smallest of `sizes` that holds them
        (ascending); returns that size."""
        t = input_ids.shape[0]
        size = next(s for s in sizes if s >= t)
        ids, positions, slots = self.meta
        ids[:t].copy_(input_ids)
        positions[:t].copy_(batch.positions)
        slots[:t].copy_(batch.out_cache_loc)
        if size > t:
            self.meta[:, t:size].copy_(self.pad.expand(3, size - t))
        return size


class PrefillGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attn: AttentionBackend,
        req_to_token: torch.Tensor,
        scratch_slot: int,
        scratch_row: int,
        max_tokens: int,
        device: torch.device,
        pool: Any,  # torch.cuda.graph_pool_handle()'s, shared with the decode graphs
    ) -> None:
        self.model = model
        self.attn = attn
        self.req_to_token = req_to_token
        self.sizes = prefill_capture_sizes(max_tokens)
        if not self.sizes:
            raise ValueError(f"no prefill graph fits {max_tokens} tokens")
        n = self.sizes[-1]
        self.device = device
        self.tokens = TokenRows(n, scratch_slot, device)
        self.input_ids, self.positions, self.out_cache_loc = self.tokens.meta
        self.req_slot = torch.full((1,), scratch_row, dtype=torch.int64, device=device)
        self.logit_row = torch.zeros(1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.replays = 0  # cumulative (a worker's metrics)

    def can_run(self, batch: ForwardBatch, logit_rows: int) -> bool:
        """One prompt, no cached prefix, at most the largest captured length, its last
        row's logits or none (the caller excludes prompt logprobs)."""
        return (
            not batch.is_decode
            and batch.batch_size == 1
            and batch.prefix_lens_list[0] == 0
            and batch.extend_lens_list[0] <= self.sizes[-1]
            and logit_rows <= 1
        )

    def _batch(self, size: int) -> ForwardBatch:
        lens = torch.tensor([size], dtype=torch.int64, device=self.device)
        return ForwardBatch(
            positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size],
            req_slots=self.req_slot,
            seq_lens=lens,
            extend_lens=lens,
            prefix_lens=torch.zeros_like(lens),
            req_to_token=self.req_to_token,
            seq_lens_list=[size],
            extend_lens_list=[size],
            prefix_lens_list=[0],
        )

    def _forward(self, size: int, batch: ForwardBatch) -> torch.Tensor:
        ids = self.input_ids[:size]
        return self.model(ids, batch.positions, batch, self.attn, self.logit_row)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        for size in reversed(self.sizes):
            batch = self._batch(size)
            self.attn.prepare_single_prompt()  # True: the model runner checked before
            self.graphs[size], self.outputs[size] = capture_graph(
                lambda: self._forward(size, batch),  # noqa: B023 - called in this iteration
                self.pool,
            )
        torch.cuda.synchronize()
        log.info(
            "captured CUDA graphs for prompts of up to %s tokens (%s lengths) in %.1f s",
            self.sizes[-1],
            len(self.sizes),
            time.monotonic() - start,
        )

    def run(
        self, input_ids: torch.Tensor, batch: ForwardBatch, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """The logits of `logit_rows` (the prompt's last row, or none)."""
        size = self.tokens.fill(input_ids, batch, self.sizes)
        if logit_rows.numel():
            self.logit_row.copy_(logit_rows)
        self.attn.prepare_single_prompt()
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][: logit_rows.numel()]
