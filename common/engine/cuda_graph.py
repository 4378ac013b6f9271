"""CUDA graphs for decode steps, captured for a set of padded batch sizes.

A decode step of batch size b replays the graph of the smallest captured size >= b.
Padding rows read page 0 (harmless) and write their KV into a scratch page that the
allocator never hands out, so padded rows never touch a real request's memory.
Few operations run between two replays: the graph looks up the tokens still being
sampled in the future map itself (`resolve_future`); it ends with the greedy token of every
row (`argmax_rows`) written into the future map, so a step of plain greedy requests samples
inside the graph and leaves only the copy to the host after it; and the step's positions,
KV slots, table rows, lengths and future-map entries arrive in one copy where they lie one
after another in memory, as `to_device` uploads them.
The attention backend supplies fixed-buffer plans through `prepare_graph`.

A step whose rows draw (temperature, top-k, top-p, min-p, a seed), with nothing else to
apply, draws in a second, small graph replayed right after the forward's (`draw`): its
rows' settings arrive in the same copy as the step's positions, and the graph writes the
tokens into the future map as the forward's does. One draw graph per padded batch size
and `DrawKind`: those of `EARLY_DRAWS` at every size before the worker serves
(`capture_draws`), the others the first time a step needs one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from baton.common.attention.base import AttentionBackend, ForwardBatch
from baton.common.layers.argmax import argmax_rows
from baton.common.layers.draw import draw
from baton.common.layers.graph_draw import DrawKind, graph_draw, graph_filters
from baton.common.layers.sampler import SamplingRow

log = logging.getLogger(__name__)
T = TypeVar("T")

# Draw graphs captured at start, at every batch size: temperature alone, and with top-p
# (what OpenAI's API and most clients send). About 10 ms each on an idle H200.
EARLY_DRAWS = (DrawKind(0, False, False), DrawKind(0, True, False))
SLOW_CAPTURE_S = 10.0  # a decode-graph capture this long compiled kernels (the log says so)


def capture_graph(
    forward: Callable[[], T], pool: Any, mode: str = "global"
) -> tuple[torch.cuda.CUDAGraph, T]:
    """`forward` captured in a CUDA graph whose memory comes from `pool`, after two runs
    outside it (allocations, autotuning); and the output the graph writes. `mode`
    "thread_local" lets other threads use CUDA meanwhile (a capture while serving)."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        out = forward()
    return graph, out


def graph_page_capacity(max_bs: int, max_context: int, page_size: int) -> int:
    """Entries the page-index buffer of a decode graph needs: every row of the largest
    padded batch at the longest context. Rows share pages through the prefix cache, so
    the pool's size is no bound; a padding row takes one page."""
    return capture_sizes(max_bs)[-1] * -(-(max_context + 1) // page_size)


def resolve_future(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """`ids` with each reference -i < 0 replaced by entry i of the future map: the token a
    step still in flight samples for that request."""
    return torch.where(ids < 0, future[(-ids).clamp(min=0)], ids)


def _adjacent(parts: list[torch.Tensor], b: int) -> torch.Tensor | None:
    """`parts`, each of `b` elements, as one [len(parts), b] view where they lie one after
    another in one tensor's memory (`to_device` uploads a step's metadata so, on rank 0 and
    on TP followers); None otherwise."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    for i, t in enumerate(parts):
        if (
            t.numel() != b
            or t.dtype != first.dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.data_ptr() != first.data_ptr() + i * b * first.element_size()
        ):
            return None
    return first.as_strided((len(parts), b), (b, 1))


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [
        1,
        2,
        4,
        8,
        12,
        16,
        24,
        32,
        48,
        64,
        80,
        96,
        112,
        128,
        160,
        192,
        224,
        256,
        320,
        384,
        448,
        512,
    ]
    below = [s for s in sizes if s < max_bs]
    return [*below, max(max_bs, 1)]  # the largest batch itself: no batch up to it runs eager


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attn: AttentionBackend,
        req_to_token: torch.Tensor,
        scratch_slot: int,
        scratch_row: int,
        max_bs: int,
        max_pages: int,
        device: torch.device,
        future: torch.Tensor | None = None,
    ) -> None:
        """`future`: the runner's future map; input ids -i < 0 read its entry i."""
        self.model = model
        self.attn = attn
        self.req_to_token = req_to_token
        self.scratch_slot = scratch_slot
        self.scratch_row = scratch_row
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.max_pages = max_pages
        self.future = future
        n = self.max_bs
        z = torch.zeros
        self.input_ids = z(n, dtype=torch.int64, device=device)
        # positions, out_cache_loc, req_slots, seq_lens, the future-map entries that
        # receive each row's token (0: an entry never handed out), and a drawing step's
        # settings (`graph_draw.graph_draw`): rows of one buffer, one copy a step
        self.meta = z(10, n, dtype=torch.int64, device=device)
        self.positions, self.out_cache_loc, self.req_slots, self.seq_lens, self.future_out = (
            self.meta[:5]
        )
        self.knobs = self.meta[5:]
        self.seq_lens.fill_(1)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits, greedy tokens
        self.replays = 0  # cumulative (a worker's metrics)
        self.pool = torch.cuda.graph_pool_handle()
        # (padded size, kind) -> the graph and its tokens; None: it could not be captured
        self.draw_graphs: dict[
            tuple[int, DrawKind], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None
        ] = {}
        self.draw_replays = 0  # cumulative

    def _padded(self, b: int) -> int:
        """The captured size a step of `b` rows replays."""
        return next(s for s in self.sizes if s >= b)

    def _ids(self, bs: int) -> torch.Tensor:
        raw = self.input_ids[:bs]
        return raw if self.future is None else resolve_future(raw, self.future)

    def can_run(self, batch: ForwardBatch, logit_rows: int) -> bool:
        """A decode step whose every row is sampled (the graph computes every row's
        logits, in order)."""
        return (
            batch.is_decode and batch.batch_size <= self.max_bs and logit_rows == batch.batch_size
        )

    def _forward(self, bs: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(self._ids(bs), batch.positions, batch, self.attn, self.rows[:bs])
        tokens = argmax_rows(logits)
        if self.future is not None:
            self.future[self.future_out[:bs]] = tokens
        return logits, tokens

    def _batch(self, bs: int, seq_lens: list[int]) -> ForwardBatch:
        return ForwardBatch(
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_slots=self.req_slots[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.ones[:bs],
            prefix_lens=self.seq_lens[:bs] - 1,
            req_to_token=self.req_to_token,
            seq_lens_list=seq_lens,
            extend_lens_list=[1] * bs,
            prefix_lens_list=[n - 1 for n in seq_lens],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        self.out_cache_loc.fill_(self.scratch_slot)
        self.req_slots.fill_(self.scratch_row)
        for bs in reversed(self.sizes):
            batch = self._batch(bs, [1] * bs)
            self.attn.prepare_graph(bs, batch, self.max_pages)  # type: ignore[attr-defined]
            self.graphs[bs], self.outputs[bs] = capture_graph(
                lambda: self._forward(bs, batch),  # noqa: B023 - called in this iteration
                self.pool,
            )
        torch.cuda.synchronize()
        seconds = time.monotonic() - start
        log.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s%s",
            self.sizes,
            seconds,
            # (H200, s35: 3.0 s with Triton's cache carried, 22.6 s compiling without it)
            " (slow: kernels missing from the caches compiled in it)"
            if seconds > SLOW_CAPTURE_S
            else "",
        )

    def run(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        future_out: torch.Tensor,
        knobs: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' logits and greedy tokens. `input_ids` may still hold future references;
        the greedy tokens are written into the future map at `future_out` (one entry a row;
        empty on TP followers, whose map nobody reads). `knobs`: the rows' settings for a
        `draw` after this (`graph_draw.graph_draw`'s columns)."""
        b = batch.batch_size
        bs = self._padded(b)
        self.input_ids[:b].copy_(input_ids)
        rows = [batch.positions, batch.out_cache_loc, batch.req_slots, batch.seq_lens]
        if future_out.numel():  # a follower never passes entries: its row stays 0 throughout
            rows.append(future_out)
            rows += knobs or []
        meta = _adjacent(rows, b)
        if meta is not None:
            self.meta[: len(rows), :b].copy_(meta)
        else:
            for i, row in enumerate(rows):
                self.meta[i, :b].copy_(row)
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].fill_(self.scratch_slot)
            self.req_slots[b:bs].fill_(self.scratch_row)
            self.seq_lens[b:bs].fill_(1)
            self.future_out[b:bs].zero_()
            if knobs:
                self.knobs[:, b:bs].zero_()  # greedy rows
        padded = self._batch(bs, batch.seq_lens_list + [1] * (bs - b))
        self.attn.prepare_graph(bs, padded, self.max_pages)  # type: ignore[attr-defined]
        self.graphs[bs].replay()
        self.replays += 1
        logits, tokens = self.outputs[bs]
        return logits[:b], tokens[:b]

    def plan_draw(
        self, rows: list[SamplingRow], num_tokens: int
    ) -> tuple[DrawKind, list[np.ndarray]] | None:
        """`graph_draw.graph_draw` of a step these graphs may run: one token a row, every row
        sampled, at most `max_bs` rows."""
        return graph_draw(rows) if num_tokens == len(rows) <= self.max_bs else None

    def draw(self, b: int, kind: DrawKind) -> torch.Tensor | None:
        """After `run` with `knobs`: each row's token, drawn where its temperature is not 0
        (`draw.draw`) and the greedy one elsewhere, also written into the future map.
        None where this graph could not be captured: the caller samples eagerly."""
        key = (self._padded(b), kind)
        if key not in self.draw_graphs:
            start = time.perf_counter()
            if self._capture_draw(key):
                log.info(
                    "captured a draw graph for batch size %d, %s, in %.0f ms",
                    *key,
                    (time.perf_counter() - start) * 1e3,
                )
        captured = self.draw_graphs[key]
        if captured is None:
            return None
        graph, tokens = captured
        graph.replay()
        self.draw_replays += 1
        return tokens[:b]

    def capture_draws(self, kinds: tuple[DrawKind, ...] = EARLY_DRAWS) -> None:
        """Draw graphs of `kinds` at every batch size, before serving: a draw graph first
        captured while serving stalls its step (the capture waits for the step in flight:
        11-211 ms a graph on an H200 under load, each new batch size of each kind once)."""
        start, captured = time.monotonic(), 0
        for kind in kinds:
            for bs in self.sizes:
                if (bs, kind) not in self.draw_graphs:
                    captured += self._capture_draw((bs, kind))
        log.info(
            "captured %d draw graphs (%s, batch sizes up to %d) in %.1f s",
            captured,
            ", ".join(map(str, kinds)),
            self.max_bs,
            time.monotonic() - start,
        )

    def _capture_draw(self, key: tuple[int, DrawKind]) -> bool:
        """Capture the draw graph of `key`; False (and None kept) where it cannot be."""
        try:
            self.draw_graphs[key] = capture_graph(
                lambda: self._draw(*key), self.pool, mode="thread_local"
            )
        except Exception:  # the step goes on without it, and so do later ones
            log.exception("could not capture a draw graph for batch size %d, %s", *key)
            self.draw_graphs[key] = None
            return False
        return True

    def _draw(self, bs: int, kind: DrawKind) -> torch.Tensor:
        logits, greedy_tokens = self.outputs[bs]
        greedy, filters = graph_filters(self.knobs[:, :bs], kind)
        tokens = torch.where(greedy, greedy_tokens, draw(logits, filters))
        if self.future is not None:
            self.future[self.future_out[:bs]] = tokens
        return tokens
