"""Model runner: owns the model, the KV pool, the attention backend and the future map.

`prepare(batch)` runs on the scheduler thread and turns a `ScheduledBatch` into plain
tensors; `execute(inputs)` runs wherever the overlap loop puts it (a worker thread) and
never needs the host: input ids that refer to tokens not sampled yet are negative
indices into the future map, resolved on the device, and sampled tokens are written
back into it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from baton.common.attention import ForwardBatch, create_attention
from baton.common.cache.kv_pool import KVPool
from baton.common.cache.req_to_token import ReqToTokenTable
from baton.common.config import EngineConfig, ModelConfig
from baton.common.devices import to_device
from baton.common.distributed import leave_tp, tp
from baton.common.engine.cuda_graph import CudaGraphRunner
from baton.common.engine.req import Req, ScheduledBatch
from baton.common.layers.sampler import PenaltyState, SampleResult, SamplingRow, sample
from baton.common.models import build_model
from baton.common.models.loader import init_dummy, load_weights

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T], negative = -future index
    batch: ForwardBatch
    logit_rows: torch.Tensor  # [S] token rows whose logits are sampled
    rows: list[SamplingRow]
    future_out: torch.Tensor  # [S] future-map indices receiving the samples
    table_writes: list[tuple[int, int, list[int]]]
    # TP with KV transfer: pages moved between the ranks' pools and rank 0's wire buffer
    kv_scatter: list[int] = field(default_factory=list)  # before the forward (received KV)
    kv_gather: list[int] = field(default_factory=list)  # after the forward (KV to send)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig) -> None:
        self.tp_followers: list = []
        if cfg.tp_size > 1 and tp().size == 1:  # rank 0 of a new group
            if model_cfg.num_kv_heads % cfg.tp_size or model_cfg.num_heads % cfg.tp_size:
                raise ValueError(
                    f"tp_size {cfg.tp_size} must divide the model's {model_cfg.num_heads} "
                    f"attention heads and {model_cfg.num_kv_heads} KV heads"
                )
            from baton.common.engine.tp import start_group

            self.tp_followers = start_group(cfg)
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
        self.model = model.train(False)  # inference mode for every submodule
        g = tp()
        kv_heads = max(model_cfg.num_kv_heads // g.size, 1)
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
            cfg.decode_attention_backend or cfg.attention_backend,
            self.pool,
            model_cfg.num_heads // g.size,
            model_cfg.head_dim,
        )
        # rank 0 of a tensor-parallel P or D worker: the KV transfer layer reads and writes
        # full-head pages here; the ranks' head shards are gathered into / scattered from it
        self.wire: torch.Tensor | None = None
        if g.size > 1 and g.rank == 0 and cfg.role != "both":
            shape = list(self.pool.buffer.shape)
            shape[4] = model_cfg.num_kv_heads
            self.wire = torch.zeros(shape, dtype=cfg.torch_dtype, device=self.device)
        self.graphs: CudaGraphRunner | None = None
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

    def capture_cuda_graphs(self, scratch_row: int) -> None:
        if not self.reserved_pages:
            return
        scratch_slot = (self.pool.num_pages - 1) * self.pool.page_size
        max_pages = self.cfg.max_running_requests * (-(-self.max_context // self.cfg.page_size))
        max_pages = min(max_pages, self.pool.num_pages)
        self.graphs = CudaGraphRunner(
            self.model,
            self.attn,
            self.table.table,
            scratch_slot,
            scratch_row,
            min(self.cfg.cuda_graph_max_bs, self.cfg.max_running_requests),
            max_pages,
            self.device,
        )
        self.graphs.capture()

    # -- host side ---------------------------------------------------------------------
    def _future_slot(self) -> int:
        idx = self._next_future
        self._next_future = idx % self.future_size + 1
        return idx

    def prepare(
        self, sb: ScheduledBatch, table_writes: list[tuple[int, int, list[int]]]
    ) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        logit_rows: list[int] = []
        rows: list[SamplingRow] = []
        future_out: list[int] = []
        seq_lens: list[int] = []
        for req, n, prefix, do_sample, slots in zip(
            sb.reqs, sb.extend_lens, sb.prefix_lens, sb.sample, sb.kv_slots, strict=True
        ):
            if n == 1 and req.in_flight:
                ids.append(-req.future)  # the newest token is still being sampled
            else:
                ids.extend(req.fill_ids[prefix : prefix + n])
            positions.extend(range(prefix, prefix + n))
            out_loc.extend(slots)
            seq_lens.append(prefix + n)
            if do_sample:
                logit_rows.append(len(ids) - 1)
                rows.append(self._sampling_row(req))
                req.future = self._future_slot()
                future_out.append(req.future)
        (
            positions_t,
            out_loc_t,
            slots_t,
            seq_lens_t,
            extend_t,
            prefix_t,
            ids_t,
            rows_t,
            future_t,
        ) = to_device(
            [
                positions,
                out_loc,
                [r.slot for r in sb.reqs],
                seq_lens,
                sb.extend_lens,
                sb.prefix_lens,
                ids,
                logit_rows,
                future_out,
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
            extend_lens_list=list(sb.extend_lens),
            prefix_lens_list=list(sb.prefix_lens),
        )
        return StepInputs(
            input_ids=ids_t,
            batch=batch,
            logit_rows=rows_t,
            rows=rows,
            future_out=future_t,
            table_writes=table_writes,
        )

    def _sampling_row(self, req: Req) -> SamplingRow:
        p = req.sampling
        if p.uses_penalties and req.penalty is None:
            req.penalty = PenaltyState(
                req.input_ids, req.output_ids, self.model_cfg.vocab_size, self.device
            )
        block = []
        if req.output_len < p.min_new_tokens:
            block = sorted(req.stop_ids)
        return SamplingRow(p, req.seed, req.output_len, block, req.penalty)

    # -- device side -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> SampleResult:
        ids = inputs.input_ids
        ids = torch.where(ids < 0, self.future[(-ids).clamp(min=0)], ids)
        if tp().size > 1:
            from baton.common.engine.tp import send_step

            send_step(inputs, ids)
        logits = self.forward(inputs, ids)
        if not inputs.rows:
            return SampleResult(
                torch.empty(0, dtype=torch.int64, device=self.device), None, None, None
            )
        result = sample(logits, inputs.rows)
        self.future[inputs.future_out] = result.tokens
        return result

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, ids: torch.Tensor) -> torch.Tensor:
        """The model on this rank: table writes, then logits of the sampled rows."""
        if inputs.table_writes:
            self.table.write_many(inputs.table_writes)
        if inputs.kv_scatter:
            self._scatter_pages(inputs.kv_scatter)
        logits = self._model_forward(inputs, ids)
        if inputs.kv_gather:
            self._gather_pages(inputs.kv_gather)
        return logits

    def kv_transfer_buffer(self) -> torch.Tensor:
        """What the KV transfer layer reads and writes: full-head pages."""
        return self.wire if self.wire is not None else self.pool.buffer

    def _gather_pages(self, pages: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        local = self.pool.buffer.index_select(0, idx).contiguous()
        g = tp()
        parts = [torch.empty_like(local) for _ in range(g.size)] if g.rank == 0 else None
        torch.distributed.gather(local, parts, dst=0)
        if self.wire is not None and parts is not None:
            self.wire.index_copy_(0, idx, torch.cat(parts, dim=4))

    def _scatter_pages(self, pages: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        g = tp()
        local = torch.empty(
            (len(pages), *self.pool.buffer.shape[1:]), dtype=self.pool.dtype, device=self.device
        )
        parts = None
        if self.wire is not None:
            parts = [p.contiguous() for p in self.wire.index_select(0, idx).chunk(g.size, dim=4)]
        torch.distributed.scatter(local, parts, src=0)
        self.pool.buffer.index_copy_(0, idx, local)

    def _model_forward(self, inputs: StepInputs, ids: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.batch):
            logits = self.graphs.run(ids, inputs.batch).float()
        else:
            self.attn.prepare(inputs.batch)
            logits = self.model(
                ids, inputs.batch.positions, inputs.batch, self.attn, inputs.logit_rows
            )
        return logits

    def shutdown(self) -> None:
        if self.tp_followers:
            from baton.common.engine.tp import send_stop

            send_stop()
            for p in self.tp_followers:
                p.join(timeout=30)
            self.tp_followers = []
            leave_tp()
