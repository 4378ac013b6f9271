"""One step as a value.

    ScheduledBatch ──▶ StepColumns: host values, built once (`ModelRunner.prepare`)
                            │ one upload on every rank (`StepColumns.upload`); with TP,
                            │ rank 0 sends them to its followers as they are (`tp_step`)
                            ▼
                       Step: the columns on the device, and rank 0's sampling
                            ──▶ `ModelRunner.execute` (rank 0) / `forward` (every rank)

`StepColumns` is what every rank computes from. A `Step` adds what rank 0 alone uses: the
input ids with their future references, the sampling rows and the future-map entries their
tokens go to, grammar masks and prompt logprobs. A prompt's columns are thousands of values
long and stay numpy arrays until the upload (`devices.flat_array`); a decode step's are one
value a request. `InFlight` is a launched step whose results the scheduler has not processed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from baton.common.attention.base import ForwardBatch
from baton.common.devices import Ints, flat_array, to_device
from baton.common.layers.sampler import SampleResult, SamplingRow
from baton.common.state import Req, ScheduledBatch

if TYPE_CHECKING:
    from concurrent.futures import Future

    from baton.common.cache.page_moves import PageMoves
    from baton.common.distributed.wire import KVWire
    from baton.common.layers.grammar import Matcher
    from baton.common.layers.graph_draw import DrawKind

TableWrite = tuple[int, int, Ints]  # (table row, first column, the KV slots it holds)


class StepColumns(msgspec.Struct, array_like=True):
    """The host values of one step, the same on every rank: T tokens of B requests, and
    the token rows whose logits are needed (S sampled, then P of prompt logprobs)."""

    positions: Ints  # [T]
    out_cache_loc: Ints  # [T] the KV slots the tokens write
    req_slots: list[int]  # [B] rows of the req-to-token table
    seq_lens: list[int]  # [B] tokens with KV after the step
    extend_lens: list[int]  # [B] tokens the step computes
    prefix_lens: list[int]  # [B] tokens with KV before the step
    logit_rows: list[int]  # [S + P] sampled rows first
    table_writes: list[TableWrite]  # into the req-to-token table, with the step

    @classmethod
    def of(
        cls, sb: ScheduledBatch, table_writes: list[TableWrite], prompt_rows: list[int]
    ) -> StepColumns:
        positions: list[Ints] = []
        out_loc: list[Ints] = []
        logit_rows: list[int] = []
        num_tokens = 0
        req_slots: list[int] = []
        for item in sb.items:
            assert item.req.slot is not None  # a scheduled request holds its table row
            req_slots.append(item.req.slot)
            positions.append(range(item.prefix_len, item.end))
            out_loc.append(item.kv_slots)
            num_tokens += item.extend_len
            if item.sample:
                logit_rows.append(num_tokens - 1)
        return cls(
            positions=flat_array(positions, torch.int64),
            out_cache_loc=flat_array(out_loc, torch.int64),
            req_slots=req_slots,
            seq_lens=[it.end for it in sb.items],
            extend_lens=[it.extend_len for it in sb.items],
            prefix_lens=[it.prefix_len for it in sb.items],
            logit_rows=logit_rows + prompt_rows,
            table_writes=table_writes,
        )

    def upload(
        self,
        device: torch.device,
        req_to_token: torch.Tensor,
        sampled: Sequence[Ints] = (),
        ids: Ints = (),
    ) -> tuple[ForwardBatch, torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The batch and its logit rows on `device`, with rank 0's `sampled` columns
        (future-map entries, then draw knobs) and input `ids`, in one copy. The request
        columns and `sampled` lie one after another: a decode graph takes them in one piece
        (`CudaGraphRunner.run`)."""
        positions, out_loc, slots, seq_lens, *sampled_t, extend, prefix, ids_t, rows = to_device(
            [
                self.positions,
                self.out_cache_loc,
                self.req_slots,
                self.seq_lens,
                *sampled,
                self.extend_lens,
                self.prefix_lens,
                ids,
                self.logit_rows,
            ],
            device,
        )
        batch = ForwardBatch(
            positions=positions,
            out_cache_loc=out_loc,
            req_slots=slots,
            seq_lens=seq_lens,
            extend_lens=extend,
            prefix_lens=prefix,
            req_to_token=req_to_token,
            seq_lens_list=self.seq_lens,
            extend_lens_list=self.extend_lens,
            prefix_lens_list=self.prefix_lens,
        )
        return batch, rows, sampled_t, ids_t


def input_ids(sb: ScheduledBatch) -> tuple[np.ndarray, bool]:
    """The step's input ids, and whether any is a future reference: a request whose newest
    token is still being sampled reads it as minus its future-map index."""
    parts: list[Ints] = []
    futures = False
    for item in sb.items:
        req = item.req
        if item.extend_len == 1 and req.in_flight:
            parts.append([-req.future])
            futures = True
        else:
            parts.append(req.fill_ids[item.prefix_len : item.end])
    return flat_array(parts, torch.int64), futures


def sampling_rows(
    sb: ScheduledBatch, vocab: int, device: torch.device, next_future: Callable[[], int]
) -> tuple[list[SamplingRow], list[int], list[tuple[int, Matcher]]]:
    """The rows of the requests the step samples for, the future-map entries their tokens
    go to (each request's new `future`, from `next_future`), and the rows a grammar masks."""
    rows: list[SamplingRow] = []
    future_out: list[int] = []
    grammars: list[tuple[int, Matcher]] = []
    for item in sb.items:
        if not item.sample:
            continue
        req = item.req
        if req.grammar is not None:
            if req.in_flight:  # the scheduler processes such a step first
                raise RuntimeError(f"{req.rid}: grammar behind an unprocessed token")
            grammars.append((len(rows), req.grammar))
        rows.append(SamplingRow.of(req, vocab, device))
        req.future = next_future()
        future_out.append(req.future)
    return rows, future_out, grammars


@dataclass
class PromptRows:
    """Prompt logprobs: the P token rows after the sampled ones, the prompt token each
    predicts, and which request positions they are (request, first position, count)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    spans: list[tuple[Req, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, sb: ScheduledBatch) -> PromptRows:
        out = cls()
        first_row = 0
        for item in sb.items:
            req = item.req
            if req.computes_prompt_logprobs:
                # position p's logits predict prompt token p + 1
                last = min(item.end, len(req.input_ids) - 1)
                if last > item.prefix_len:
                    out.rows.extend(range(first_row, first_row + last - item.prefix_len))
                    out.targets.extend(req.input_ids[item.prefix_len + 1 : last + 1])
                    out.spans.append((req, item.prefix_len, last - item.prefix_len))
            first_row += item.extend_len
        return out


@dataclass
class Step:
    """One step on the device. TP followers hold the columns' part alone: no sampling rows,
    no future-map entries."""

    columns: StepColumns  # the host values it was uploaded from
    input_ids: torch.Tensor  # [T], negative = -future index
    batch: ForwardBatch
    logit_rows: torch.Tensor  # [S + P]
    future_out: torch.Tensor  # [S] future-map indices receiving the samples
    rows: list[SamplingRow] = field(default_factory=list)  # [S]
    futures: bool = True  # whether input_ids holds future references (a prompt's never do)
    grammar_mask: torch.Tensor | None = None  # [S, V/32] tokens each row's grammar allows
    # a step that draws in a decode graph: the graph's kind and the rows' settings
    draw: DrawKind | None = None
    knobs: list[torch.Tensor] = field(default_factory=list)
    # prompt logprobs: the token each of the P rows predicts, and their positions
    prompt_targets: torch.Tensor | None = None  # [P]
    prompt_top: int = 0
    prompt_spans: list[tuple[Req, int, int]] = field(default_factory=list)
    # TP with KV transfer: pages moved between the ranks' pools and rank 0's wire buffer
    kv_scatter: list[int] = field(default_factory=list)  # before the forward (received KV)
    kv_gather: list[int] = field(default_factory=list)  # after the forward (KV to send)
    wire: KVWire | None = None  # rank 0's full-head buffer those pages move through
    page_moves: PageMoves | None = None  # host-tier copies, run before the forward
    done: torch.cuda.Event | None = None  # recorded after the forward (CUDA)
    # how it ran, for a stall's log line: the forward's path ("decode graph", "prompt
    # graph", "pieces", "eager") and `execute`'s own time on the host, which a kernel
    # compiled on first use or a paused process lengthens and the device's work does not
    ran: str = ""
    host_seconds: float = 0.0


@dataclass
class InFlight:
    """A launched step whose results are not processed yet."""

    batch: ScheduledBatch
    step: Step
    result: Future[SampleResult]
    launched: float  # time.perf_counter() at launch
