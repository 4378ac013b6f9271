"""Model runner: the model, its KV pool and table, the attention backend, CUDA graphs and
the future map, on one rank. The tensor-parallel group is started by the process entry
point (see `tp.start_followers`), not here.

`prepare(batch)` runs on the scheduler thread and turns a `ScheduledBatch` into plain
tensors; `execute(inputs)` runs wherever the overlap loop puts it (a worker thread) and
never needs the host: input ids that refer to tokens not sampled yet are negative
indices into the future map, resolved on the device, and sampled tokens are written
back into it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from baton.common.attention import ForwardBatch, create_attention, default_decode_backend
from baton.common.cache.kv_pool import KVPool
from baton.common.cache.manager import check_step_writes
from baton.common.cache.req_to_token import ReqToTokenTable
from baton.common.config import EngineConfig, ModelConfig
from baton.common.devices import Ints, flat_array, to_device
from baton.common.distributed import tp
from baton.common.distributed.wire import KVWire
from baton.common.engine.cuda_graph import CudaGraphRunner, graph_page_capacity, resolve_future
from baton.common.engine.memory import pool_tokens
from baton.common.engine.prefill_graph import PrefillGraphRunner
from baton.common.engine.recovery import FatalEngineError
from baton.common.env import CHECK_STEPS
from baton.common.layers.grammar import Matcher, grammar_bitmask
from baton.common.layers.graph_draw import DrawKind
from baton.common.layers.sampler import (
    SampleResult,
    SamplingRow,
    plain_greedy,
    prompt_logprobs,
    sample,
)
from baton.common.models import build_model
from baton.common.models.loader import init_dummy, load_weights
from baton.common.state import Req, ScheduledBatch

log = logging.getLogger(__name__)
_CHECK_STEPS = CHECK_STEPS.get()  # read once


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T], negative = -future index
    batch: ForwardBatch
    logit_rows: torch.Tensor  # [S + P] token rows whose logits are needed: sampled ones first
    rows: list[SamplingRow]
    future_out: torch.Tensor  # [S] future-map indices receiving the samples
    table_writes: list[tuple[int, int, Ints]]
    grammar_mask: torch.Tensor | None = None  # [S, V/32] tokens each row's grammar allows
    futures: bool = True  # whether input_ids holds future references (a prompt's never do)
    # a step that draws in a decode graph: the graph's kind and the rows' settings
    draw: DrawKind | None = None
    knobs: list[torch.Tensor] = field(default_factory=list)
    # prompt logprobs: the P rows after the sampled ones, the token each predicts, and
    # which request positions they are (request, first position, count)
    prompt_targets: torch.Tensor | None = None  # [P]
    prompt_top: int = 0
    prompt_spans: list[tuple[Req, int, int]] = field(default_factory=list)
    # TP with KV transfer: pages moved between the ranks' pools and rank 0's wire buffer
    kv_scatter: list[int] = field(default_factory=list)  # before the forward (received KV)
    kv_gather: list[int] = field(default_factory=list)  # after the forward (KV to send)
    wire: KVWire | None = None  # rank 0's full-head buffer those pages move through
    done: torch.cuda.Event | None = None  # recorded after the forward (CUDA)
    # host values of positions, out_cache_loc, req_slots and logit_rows (TP's step header)
    host_lists: tuple[Ints, Ints, list[int], list[int]] = field(
        default_factory=lambda: ([], [], [], [])
    )


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = torch.device(cfg.device)
        torch.manual_seed(cfg.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(cfg.torch_dtype)  # build in the target dtype: no fp32 copy
        try:
            with torch.device(self.device):
                model = build_model(model_cfg)
        finally:
            torch.set_default_dtype(default_dtype)
        if cfg.load_format == "dummy":
            init_dummy(model, cfg.seed)
        else:
            load_weights(model, model_cfg.path)
        for module in model.modules():  # layouts the device's kernels want (gate_up.py)
            if hasattr(module, "after_load"):
                module.after_load()
        self.model = model.train(False)  # inference mode for every submodule
        g = tp()
        kv_heads = max(model_cfg.num_kv_heads // g.size, 1)
        tokens = pool_tokens(cfg, model_cfg, self.device, kv_heads)
        self.cfg = cfg = dataclasses.replace(cfg, max_total_tokens=tokens)  # auto resolved
        self.pool = KVPool(
            cfg.num_pages,
            cfg.page_size,
            model_cfg.num_layers,
            kv_heads,
            model_cfg.head_dim,
            cfg.torch_dtype,
            self.device,
        )
        self.max_context = model_cfg.context_len
        self.table = ReqToTokenTable(
            cfg.max_running_requests + 1, self.max_context + 1, self.device
        )
        self.attn = create_attention(
            cfg.prefill_attention_backend or cfg.attention_backend,
            cfg.decode_attention_backend or default_decode_backend(cfg.attention_backend),
            self.pool,
            model_cfg.num_heads // g.size,
            model_cfg.head_dim,
        )
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        # with CUDA graphs, the last page and the last table row are padding scratch
        use_graphs = (
            not cfg.disable_cuda_graph
            and self.device.type == "cuda"
            and self.attn.supports_cuda_graph()
        )
        self.reserved_pages = 1 if use_graphs else 0
        self.future_size = 4 * (cfg.max_running_requests + 1)
        self.future = torch.zeros(self.future_size + 1, dtype=torch.int64, device=self.device)
        self._next_future = 1
        self._follower_wire: KVWire | None = None

    def capture_cuda_graphs(self, scratch_row: int) -> None:
        if not self.reserved_pages:
            return
        scratch_slot = (self.pool.num_pages - 1) * self.pool.page_size
        max_bs = min(self.cfg.cuda_graph_max_bs, self.cfg.max_running_requests)
        self.graphs = CudaGraphRunner(
            self.model,
            self.attn,
            self.table.table,
            scratch_slot,
            scratch_row,
            max_bs,
            graph_page_capacity(max_bs, self.max_context, self.cfg.page_size),
            self.device,
            self.future,
        )
        self.graphs.capture()
        # one rank only: a prompt's graph holds no collectives (TP's ranks decide alike,
        # but capturing all-reduces in many more graphs is not worth it yet)
        if (
            self.cfg.prefill_graph_max_tokens
            and tp().size == 1
            and self.attn.prepare_single_prompt()
        ):
            self.prefill_graphs = PrefillGraphRunner(
                self.model,
                self.attn,
                self.table.table,
                scratch_slot,
                scratch_row,
                self.cfg.prefill_graph_max_tokens,
                self.device,
                self.graphs.pool,  # one step at a time: decode and prompt graphs share memory
            )
            self.prefill_graphs.capture()

    # -- host side ---------------------------------------------------------------------
    def _future_slot(self) -> int:
        idx = self._next_future
        self._next_future = idx % self.future_size + 1
        return idx

    def prepare(self, sb: ScheduledBatch, table_writes: list[tuple[int, int, Ints]]) -> StepInputs:
        if _CHECK_STEPS:  # memory handed out twice: nothing after it can be trusted
            try:
                check_step_writes([it.kv_slots for it in sb.items], table_writes)
            except AssertionError as exc:
                raise FatalEngineError(str(exc)) from exc
        # columns of the step's tokens, in parts: a prompt's are thousands of values long
        # and go to numpy whole (`flat_array`), a decode step's are one value each
        id_parts: list[Ints] = []
        position_parts: list[Ints] = []
        out_loc_parts: list[Ints] = []
        num_ids = 0
        logit_rows: list[int] = []
        rows: list[SamplingRow] = []
        future_out: list[int] = []
        seq_lens: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_spans: list[tuple[Req, int, int]] = []
        grammar_rows: list[tuple[int, Matcher]] = []
        futures = False
        for item in sb.items:
            req = item.req
            first_row = num_ids
            if item.extend_len == 1 and req.in_flight:
                id_parts.append([-req.future])  # the newest token is still being sampled
                futures = True
            else:
                id_parts.append(req.fill_ids[item.prefix_len : item.end])
            num_ids += item.extend_len
            if req.computes_prompt_logprobs:
                # position p's logits predict prompt token p + 1
                last = min(item.end, len(req.input_ids) - 1)
                if last > item.prefix_len:
                    prompt_rows.extend(range(first_row, first_row + last - item.prefix_len))
                    prompt_targets.extend(req.input_ids[item.prefix_len + 1 : last + 1])
                    prompt_spans.append((req, item.prefix_len, last - item.prefix_len))
            position_parts.append(range(item.prefix_len, item.end))
            out_loc_parts.append(item.kv_slots)
            seq_lens.append(item.end)
            if item.sample:
                if req.grammar is not None:
                    if req.in_flight:  # the scheduler processes such a step first
                        raise RuntimeError(f"{req.rid}: grammar behind an unprocessed token")
                    grammar_rows.append((len(rows), req.grammar))
                logit_rows.append(num_ids - 1)
                rows.append(SamplingRow.of(req, self.model_cfg.vocab_size, self.device))
                req.future = self._future_slot()
                future_out.append(req.future)
        logit_rows += prompt_rows
        slots = [it.req.slot for it in sb.items]
        positions = flat_array(position_parts, torch.int64)
        out_loc = flat_array(out_loc_parts, torch.int64)
        drawing = None
        if self.graphs is not None and not grammar_rows and not prompt_spans:
            drawing = self.graphs.plan_draw(rows, num_ids)
        # one upload; a decode graph copies the first five and the knobs in one piece
        # (`CudaGraphRunner.run`)
        (
            positions_t,
            out_loc_t,
            slots_t,
            seq_lens_t,
            future_t,
            *knobs,
            extend_t,
            prefix_t,
            ids_t,
            rows_t,
        ) = to_device(
            [
                positions,
                out_loc,
                slots,
                seq_lens,
                future_out,
                *(drawing[1] if drawing is not None else []),
                [it.extend_len for it in sb.items],
                [it.prefix_len for it in sb.items],
                flat_array(id_parts, torch.int64),
                logit_rows,
            ],
            self.device,
        )
        batch = ForwardBatch(
            positions=positions_t,
            out_cache_loc=out_loc_t,
            req_slots=slots_t,
            seq_lens=seq_lens_t,
            extend_lens=extend_t,
            prefix_lens=prefix_t,
            req_to_token=self.table.table,
            seq_lens_list=seq_lens,
            extend_lens_list=[it.extend_len for it in sb.items],
            prefix_lens_list=[it.prefix_len for it in sb.items],
        )
        inputs = StepInputs(
            input_ids=ids_t,
            batch=batch,
            logit_rows=rows_t,
            rows=rows,
            future_out=future_t,
            table_writes=table_writes,
            futures=futures,
            host_lists=(positions, out_loc, slots, logit_rows),
        )
        if drawing is not None:
            inputs.draw, inputs.knobs = drawing[0], knobs
        if grammar_rows:
            inputs.grammar_mask = grammar_bitmask(
                len(rows), self.model_cfg.vocab_size, grammar_rows
            )
        if prompt_spans:
            inputs.prompt_targets = torch.tensor(prompt_targets, device=self.device)
            inputs.prompt_top = max(span[0].sampling.prompt_logprobs or 0 for span in prompt_spans)
            inputs.prompt_spans = prompt_spans
        return inputs

    # -- device side -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> SampleResult:
        ids = inputs.input_ids
        # a decode graph reads the map itself; resolving takes 0.25 ms of a prompt's host
        # time to its first kernel (`benchmarks/gpu_ttft.py`), so only where there are any
        if inputs.futures and (tp().size > 1 or not self._graphed(inputs)):
            ids = resolve_future(ids, self.future)
        if tp().size > 1:
            from baton.common.engine.tp import send_step

            send_step(inputs, ids)
        logits, greedy = self.forward(inputs, ids)
        if self.device.type == "cuda":
            inputs.done = torch.cuda.Event()
            inputs.done.record()
        num_sampled = len(inputs.rows)
        # a decode graph's tokens, which it also wrote into the future map: the greedy ones,
        # or those its draw graph drew (None if that could not be captured)
        tokens = None
        if greedy is not None and plain_greedy(inputs.rows, inputs.grammar_mask):
            tokens = greedy
        elif greedy is not None and inputs.draw is not None:
            assert self.graphs is not None
            tokens = self.graphs.draw(num_sampled, inputs.draw)
        if tokens is not None:
            result = SampleResult(tokens, None, None, None)
        elif num_sampled:
            result = sample(logits[:num_sampled], inputs.rows, inputs.grammar_mask)
            self.future[inputs.future_out] = result.tokens
        else:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            result = SampleResult(empty, None, None, None)
        if inputs.prompt_targets is not None:
            result.prompt = prompt_logprobs(
                logits[num_sampled:], inputs.prompt_targets, inputs.prompt_top
            )
        result.to_host()
        return result

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on this rank: table writes, then logits of the sampled rows, and their
        greedy tokens where a decode graph ran (None otherwise). Where
        the step's attention does not read the table (a ragged prefill), its writes are
        queued after the forward instead: 0.4 ms of host work off a prompt's path to the
        GPU (`benchmarks/gpu_ttft.py`)."""
        late = bool(inputs.table_writes) and not self.attn.reads_table(inputs.batch)
        if inputs.table_writes and not late:
            self.table.write_many(inputs.table_writes)
        if inputs.kv_scatter:
            self._wire(inputs).scatter(inputs.kv_scatter)
        out = self._model_forward(inputs, ids)
        if late:
            self.table.write_many(inputs.table_writes)
        if inputs.kv_gather:
            self._wire(inputs).gather(inputs.kv_gather)
        return out

    def _wire(self, inputs: StepInputs) -> KVWire:
        if inputs.wire is not None:  # rank 0: the role's buffer
            return inputs.wire
        if self._follower_wire is None:
            self._follower_wire = KVWire(self.pool, self.model_cfg.num_kv_heads, holder=False)
        return self._follower_wire

    def _graphed(self, inputs: StepInputs) -> bool:
        """Whether the step replays a CUDA graph (graphs compute the sampled rows only)."""
        graphs = self.graphs
        return (
            inputs.prompt_targets is None
            and graphs is not None
            and graphs.can_run(inputs.batch, inputs.logit_rows.numel())
        )

    def _model_forward(
        self, inputs: StepInputs, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._graphed(inputs):
            assert self.graphs is not None
            return self.graphs.run(ids, inputs.batch, inputs.future_out, inputs.knobs)
        prompt = self.prefill_graphs
        rows = inputs.logit_rows
        if (
            prompt is not None
            and inputs.prompt_targets is None
            and prompt.can_run(inputs.batch, rows.numel())
        ):
            return prompt.run(ids, inputs.batch, rows), None
        self.attn.prepare(inputs.batch)
        logits = self.model(ids, inputs.batch.positions, inputs.batch, self.attn, inputs.logit_rows)
        return logits, None

    def check_device(self) -> None:
        """Raise FatalEngineError if the device is broken (a CUDA error is sticky)."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            raise FatalEngineError(f"the device failed: {exc}") from exc

    def shutdown(self) -> None:
        pass
