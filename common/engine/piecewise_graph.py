"""CUDA graphs for steps with prompt rows, in pieces between the layers' attentions.

A step that computes prompt rows, alone or beside running requests' one-token rows (a
mixed step: `--enable-mixed-chunk`, or a decode worker computing a prompt itself), is
bound by its launch: on an H200 a step of 128 decode rows beside a 512-token chunk took
28.6 ms to launch where its kernels ran 19.8 (2026-11-29, `benchmarks/lab/gpu_mixed_step`;
py-spy: the forward thread's Python, Triton's launcher a third of it). Such a step's
attention cannot be captured once for every step (its plans depend on each request's
lengths), but what lies between two attentions can. For each padded token count N:

    piece 0       embedding, layer 0's input norm, q/k/v projection, RoPE and KV store
    piece i       layer i-1's o_proj, norms and MLP, then layer i's projection as above
    (eager)       each layer's attention of the step's real rows, planned once a step
    tail (eager)  the last layer past its attention, of the sampled rows, and the LM head

A piece ends by copying q, k and v into fixed buffers that the attention reads; the
attention's output is copied into the fixed buffer the next piece reads; the residual
stream lives in a fixed buffer every piece updates in place. Padding rows take position 0
and write their KV into the scratch page, as a decode graph's do; outside the attention
rows are independent. The tail is eager because its rows (the sampled ones) change from
step to step; it is one layer's MLP of those rows. The pieces share the decode graphs'
memory pool: a step replays them one after the other, in the order they were captured,
and steps run one at a time.

On a CPU the pieces run as plain functions over the same buffers in the same order (what
the CPU tests check); a worker captures them on CUDA only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from baton.common.attention.base import AttentionBackend, ForwardBatch
from baton.common.engine.cuda_graph import capture_graph
from baton.common.engine.prefill_graph import TokenRows, prefill_capture_sizes
from baton.common.models.llama import CausalLM, DecoderLayer, Projected

log = logging.getLogger(__name__)

Piece = Callable[[], None]


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        scratch_slot: int,
        max_tokens: int,
        device: torch.device,
        pool: Any,  # torch.cuda.graph_pool_handle()'s, shared with the decode graphs
    ) -> None:
        self.model = model
        self.attn = attn
        self.layers: list[DecoderLayer] = list(model.model.layers)  # type: ignore[arg-type]
        self.sizes = prefill_capture_sizes(max_tokens)
        if not self.sizes:
            raise ValueError(f"no piecewise graph fits {max_tokens} tokens")
        n = self.sizes[-1]
        self.device = device
        self.pool = pool
        self.tokens = TokenRows(n, scratch_slot, device)
        first = self.layers[0].self_attn
        hq, hk, d = first.num_heads, first.num_kv_heads, first.head_dim
        dtype = model.model.embed_tokens.weight.dtype
        z = torch.zeros
        self.q = z(n, hq, d, dtype=dtype, device=device)
        self.k = z(n, hk, d, dtype=dtype, device=device)
        self.v = z(n, hk, d, dtype=dtype, device=device)
        self.out = z(n, hq * d, dtype=dtype, device=device)  # attention's, read by a piece
        self.residual = z(n, model.config.hidden_size, dtype=dtype, device=device)
        self.stored = True  # the pieces store k and v themselves (Triton's fused kernel)
        self.pieces: dict[int, list[Piece]] = {}
        self.replays = 0  # cumulative steps (a worker's metrics)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Any step of at most the largest captured token count (the caller runs the decode
        and prompt graphs first); its tail computes the logits of whichever rows it asks,
        a prompt's every row for its prompt logprobs included."""
        return 0 < batch.num_tokens <= self.sizes[-1]

    def _project(self, i: int, h: Any, size: int) -> None:
        _, positions, slots = self.tokens.meta[:, :size]
        layer_kv = self.attn.pool.layer_kv(i)
        p = self.layers[i].self_attn.project(h, positions, slots, layer_kv, True)
        assert p.k is not None and p.v is not None  # keep_kv
        self.q[:size].copy_(p.q)
        self.k[:size].copy_(p.k)
        self.v[:size].copy_(p.v)
        self.stored = p.stored

    def _pieces(self, size: int) -> list[Piece]:
        """A step of `size` tokens between its attentions, as functions of the buffers."""
        ids = self.tokens.meta[0, :size]

        def first() -> None:
            h, _ = self.model.embed(ids, self.residual[:size])
            self._project(0, h, size)

        def between(i: int) -> Piece:
            def piece() -> None:
                after, reader = self.model.after_layer(i - 1)
                layer = self.layers[i - 1]
                h, _ = layer.finish(self.out[:size], self.residual[:size], after, reader)
                self._project(i, h, size)

            return piece

        return [first, *(between(i) for i in range(1, len(self.layers)))]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        graphs = self.device.type == "cuda"
        for size in reversed(self.sizes):
            pieces = self._pieces(size)
            if graphs:
                pieces = [capture_graph(piece, self.pool)[0].replay for piece in pieces]
            self.pieces[size] = pieces
        if graphs:
            torch.cuda.synchronize()
        log.info(
            "captured CUDA graphs for steps of up to %s tokens in %s pieces (%s lengths) in %.1f s",
            self.sizes[-1],
            len(self.layers),
            len(self.sizes),
            time.monotonic() - start,
        )

    def run(
        self, input_ids: torch.Tensor, batch: ForwardBatch, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """The logits of `logit_rows`."""
        t = input_ids.shape[0]
        size = self.tokens.fill(input_ids, batch, self.sizes)
        attn = self.attn
        attn.prepare(batch)
        pieces = self.pieces[size]
        pieces[0]()  # (on a CPU, says whether the pieces store k and v)
        keep_kv = attn.wants_new_kv or not self.stored
        q, k, v = self.q[:t], self.k[:t], self.v[:t]
        projected = Projected(q, k, v, self.stored) if keep_kv else Projected(q, None, None, True)
        last = len(self.layers) - 1
        out = self.out[:t]
        for i, piece in enumerate(pieces):
            if i:
                piece()
            attended = self.layers[i].self_attn.attend(projected, batch, attn)
            if i < last:
                out.copy_(attended)
        self.replays += 1
        keep = logit_rows if logit_rows.numel() < t else None
        after, reader = self.model.after_layer(last)
        h, _ = self.layers[last].finish(attended, self.residual[:t], after, reader, keep)
        return self.model.logits(h, logit_rows, keep)
