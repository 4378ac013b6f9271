"""Model runner: the model, its KV pool and table, the attention backend, CUDA graphs and
the future map, on one rank. The tensor-parallel group is started by the process entry
point (see `tp.start_followers`), not here.

`prepare(batch)` runs on the scheduler thread and turns a `ScheduledBatch` into a `Step`
(`step.py`): its host columns, built once, in one upload. `execute(step)` runs wherever
the overlap loop puts it (a worker thread) and never needs the host: input ids that refer
to tokens not sampled yet are negative indices into the future map, resolved on the
device, and sampled tokens are written back into it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from baton.common.attention import create_attention, default_decode_backend
from baton.common.cache.kv_pool import KVPool
from baton.common.cache.manager import check_step_writes
from baton.common.cache.req_to_token import ReqToTokenTable
from baton.common.config import EngineConfig, ModelConfig
from baton.common.distributed import tp
from baton.common.distributed.wire import KVWire
from baton.common.engine.cuda_graph import CudaGraphRunner, graph_page_capacity, resolve_future
from baton.common.engine.memory import pool_tokens
from baton.common.engine.piecewise_graph import PiecewiseGraphRunner
from baton.common.engine.prefill_graph import PrefillGraphRunner
from baton.common.engine.recovery import FatalEngineError
from baton.common.engine.step import (
    PromptRows,
    Step,
    StepColumns,
    TableWrite,
    input_ids,
    sampling_rows,
)
from baton.common.engine.tp_step import send_step
from baton.common.env import CHECK_STEPS, STEP_SECONDS_PER_TOKEN
from baton.common.layers.grammar import grammar_bitmask
from baton.common.layers.sampler import SampleResult, plain_greedy, prompt_logprobs, sample
from baton.common.models import build_model
from baton.common.models.loader import init_dummy, load_weights
from baton.common.state import ScheduledBatch

log = logging.getLogger(__name__)
_CHECK_STEPS = CHECK_STEPS.get()  # read once
_STEP_SECONDS_PER_TOKEN = STEP_SECONDS_PER_TOKEN.get()  # tests: a step as long as a GPU's


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
        self.piecewise_graphs: PiecewiseGraphRunner | None = None
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
        if tp().rank == 0:  # the rank that samples
            self.graphs.capture_draws()
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
        # one rank only, as a prompt's graph
        if self.cfg.piecewise_graph_max_tokens and tp().size == 1:
            self.piecewise_graphs = PiecewiseGraphRunner(
                self.model,
                self.attn,
                scratch_slot,
                self.cfg.piecewise_graph_max_tokens,
                self.device,
                self.graphs.pool,
            )
            self.piecewise_graphs.capture()

    @property
    def piecewise_sizes(self) -> list[int]:
        """The padded token counts a step with prompt rows replays pieces for (none: it
        runs eagerly)."""
        return self.piecewise_graphs.sizes if self.piecewise_graphs is not None else []

    # -- host side ---------------------------------------------------------------------
    def _future_slot(self) -> int:
        idx = self._next_future
        self._next_future = idx % self.future_size + 1
        return idx

    def prepare(self, sb: ScheduledBatch, table_writes: list[TableWrite]) -> Step:
        """The step's host columns, built once, and their one upload."""
        if _CHECK_STEPS:  # memory handed out twice: nothing after it can be trusted
            try:
                check_step_writes([it.kv_slots for it in sb.items], table_writes)
            except AssertionError as exc:
                raise FatalEngineError(str(exc)) from exc
        ids, futures = input_ids(sb)
        prompt = PromptRows.of(sb)
        columns = StepColumns.of(sb, table_writes, prompt.rows)
        vocab = self.model_cfg.vocab_size
        rows, future_out, grammars = sampling_rows(sb, vocab, self.device, self._future_slot)
        drawing = None
        if self.graphs is not None and not grammars and not prompt.spans:
            drawing = self.graphs.plan_draw(rows, sb.num_tokens)
        batch, logit_rows, (future_t, *knobs), ids_t = columns.upload(
            self.device,
            self.table.table,
            [future_out, *(drawing[1] if drawing is not None else [])],
            ids,
        )
        step = Step(columns, ids_t, batch, logit_rows, future_t, rows, futures)
        if drawing is not None:
            step.draw, step.knobs = drawing[0], knobs
        if grammars:
            step.grammar_mask = grammar_bitmask(len(rows), vocab, grammars)
        if prompt.spans:
            step.prompt_targets = torch.tensor(prompt.targets, device=self.device)
            step.prompt_top = max(req.sampling.prompt_logprobs or 0 for req, _, _ in prompt.spans)
            step.prompt_spans = prompt.spans
        return step

    # -- device side -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: Step) -> SampleResult:
        began = time.perf_counter()
        ids = step.input_ids
        # a decode graph reads the map itself; resolving takes 0.25 ms of a prompt's host
        # time to its first kernel (`benchmarks/lab/gpu_ttft.py`), so only where there are any
        if step.futures and (tp().size > 1 or not self._graphed(step)):
            ids = resolve_future(ids, self.future)
        if tp().size > 1:
            send_step(step, ids)
        logits, greedy = self.forward(step, ids)
        if _STEP_SECONDS_PER_TOKEN:
            time.sleep(_STEP_SECONDS_PER_TOKEN * len(step.columns.positions))
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        num_sampled = len(step.rows)
        # a decode graph's tokens, which it also wrote into the future map: the greedy ones,
        # or those its draw graph drew (None if that could not be captured)
        tokens = None
        if greedy is not None and plain_greedy(step.rows, step.grammar_mask):
            tokens = greedy
        elif greedy is not None and step.draw is not None:
            assert self.graphs is not None
            tokens = self.graphs.draw(num_sampled, step.draw)
        if tokens is not None:
            result = SampleResult(tokens, None, None, None)
        elif num_sampled:
            result = sample(logits[:num_sampled], step.rows, step.grammar_mask)
            self.future[step.future_out] = result.tokens
        else:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            result = SampleResult(empty, None, None, None)
        if step.prompt_targets is not None:
            result.prompt = prompt_logprobs(
                logits[num_sampled:], step.prompt_targets, step.prompt_top
            )
        result.to_host()
        step.host_seconds = time.perf_counter() - began
        return result

    @torch.inference_mode()
    def forward(self, step: Step, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on this rank: table writes, then logits of the sampled rows, and their
        greedy tokens where a decode graph ran (None otherwise). Where
        the step's attention does not read the table (a ragged prefill), its writes are
        queued after the forward instead: 0.4 ms of host work off a prompt's path to the
        GPU (`benchmarks/lab/gpu_ttft.py`)."""
        if step.page_moves is not None:  # before any write: they read pages freed to this step
            step.page_moves.run()
        late = bool(step.columns.table_writes) and not self.attn.reads_table(step.batch)
        if step.columns.table_writes and not late:
            self.table.write_many(step.columns.table_writes)
        if step.kv_scatter:
            self._wire(step).scatter(step.kv_scatter)
        out = self._model_forward(step, ids)
        if late:
            self.table.write_many(step.columns.table_writes)
        if step.kv_gather:
            self._wire(step).gather(step.kv_gather)
        return out

    def _wire(self, step: Step) -> KVWire:
        if step.wire is not None:  # rank 0: the role's buffer
            return step.wire
        if self._follower_wire is None:
            self._follower_wire = KVWire(self.pool, self.model_cfg.num_kv_heads, holder=False)
        return self._follower_wire

    def _graphed(self, step: Step) -> bool:
        """Whether the step replays a CUDA graph (graphs compute the sampled rows only)."""
        graphs = self.graphs
        return (
            step.prompt_targets is None
            and graphs is not None
            and graphs.can_run(step.batch, step.logit_rows.numel())
        )

    def _model_forward(
        self, step: Step, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._graphed(step):
            assert self.graphs is not None
            step.ran = "decode graph"
            return self.graphs.run(ids, step.batch, step.future_out, step.knobs)
        prompt = self.prefill_graphs
        rows = step.logit_rows
        if (
            prompt is not None
            and step.prompt_targets is None
            and prompt.can_run(step.batch, rows.numel())
        ):
            step.ran = "prompt graph"
            return prompt.run(ids, step.batch, rows), None
        pieces = self.piecewise_graphs
        if pieces is not None and pieces.can_run(step.batch):
            step.ran = "pieces"
            return pieces.run(ids, step.batch, rows), None
        step.ran = "eager"
        self.attn.prepare(step.batch)
        logits = self.model(ids, step.batch.positions, step.batch, self.attn, step.logit_rows)
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
        """Give the GPU memory back at once. A process that goes on after an engine (a test,
        a reference engine beside a cluster) sized its next pool 67 GiB short while the
        shut-down engine's pool was still referenced (4x H100, s21). The runner serves no
        step after this."""
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        self.graphs = None
        self.prefill_graphs = None
        self.piecewise_graphs = None
        # the pool only: a module's buffers may be caches shared across engines
        self.pool.buffer.untyped_storage().resize_(0)
        # Back to the driver, not only to torch's cache: the next engine's first tensors
        # would be cut from the cached segment, and its pool, sized from free plus cached
        # memory, no longer fit what was left of it (OOM of 67.38 GiB with 67.40 cached).
        torch.cuda.empty_cache()
