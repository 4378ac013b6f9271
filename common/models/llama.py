"""One decoder family: Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3.

They differ only in what `ModelConfig` records: attention bias (Qwen2), q/k RMSNorm
(Qwen3), explicit head_dim, tied embeddings, RoPE theta and scaling. Module names mirror
the Hugging Face checkpoints so the loader only has to fuse q/k/v and gate/up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from baton.common.attention.base import AttentionBackend, ForwardBatch
from baton.common.config import ModelConfig
from baton.common.distributed import tp
from baton.common.layers.gate_up import BLOCK, fits_weight, gate_up_silu, interleave, silu_and_mul
from baton.common.layers.kernels import qkv_rope_store
from baton.common.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from baton.common.layers.norm import RMSNorm
from baton.common.layers.rotary import RotaryEmbedding
from baton.common.layers.skinny import DOWN, GATE_UP, O_PROJ, QKV, Normed


def _rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return x if keep is None else x[keep]


class Projected(NamedTuple):
    """A layer's q [T, Hq, D] and this step's k, v [T, Hk, D], rotated. `stored`: k and v
    are in the KV pool already (one kernel projected, rotated and stored them), and k, v
    are here only where the attention reads them from here (else None)."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    stored: bool


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        g = tp()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // g.size
        self.num_kv_heads = cfg.num_kv_heads // g.size  # tp.start_followers checked it divides
        kv_full = cfg.num_kv_heads * cfg.head_dim
        # one matmul for q, k and v: this rank's q heads, then its k heads, then its v heads
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_heads * cfg.head_dim, kv_full, kv_full],
            cfg.attention_bias,
            QKV,
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, O_PROJ)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor | Normed,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """The attention output [T, Hq * D] of x's rows (`output` projects it)."""
        layer_kv = attn.pool.layer_kv(self.layer_id)
        p = self.project(x, positions, batch.out_cache_loc, layer_kv, attn.wants_new_kv)
        return self.attend(p, batch, attn)

    def project(
        self,
        x: torch.Tensor | Normed,
        positions: torch.Tensor,
        slots: torch.Tensor,
        layer_kv: torch.Tensor,
        keep_kv: bool,
    ) -> Projected:
        """q, k and v of x's rows at `positions`, rotated; k and v stored at `slots` into
        this layer's KV (`KVPool.layer_kv`) where one kernel does it all
        (`Projected.stored`). `keep_kv`: the attention reads the new k and v from
        `Projected` too."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        heads = (t, self.num_kv_heads, self.head_dim)
        qkv = self.qkv_proj(x)
        q_fused = self._rope_and_store(qkv, positions, slots, layer_kv, keep_kv)
        if q_fused is not None:
            if not keep_kv:
                return Projected(q_fused, None, None, True)
            _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # the kernel rotated k
            return Projected(q_fused, k.view(heads), v.view(heads), True)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k, v = k.view(heads), v.view(heads)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return Projected(q, k, v, False)

    def attend(self, p: Projected, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The attention output [T, Hq * D] of projected rows."""
        if p.stored:
            new_kv = None if p.k is None or p.v is None else (p.k, p.v)
            out = attn.attend(p.q, self.layer_id, batch, new_kv)
        else:
            assert p.k is not None and p.v is not None
            out = attn.forward(p.q, p.k, p.v, self.layer_id, batch)
        return out.reshape(p.q.shape[0], self.num_heads * self.head_dim)

    def output(self, out: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj of the attention output; with `keep`, of those rows only (every row's k
        and v were stored either way)."""
        return self.o_proj(_rows(out, keep))

    def _rope_and_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        layer_kv: torch.Tensor,
        keep_k: bool,
    ) -> torch.Tensor | None:
        """q/k norms, RoPE and the KV store in one kernel (Triton); None: not available."""
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return qkv_rope_store(
            qkv,
            (self.num_heads, self.num_kv_heads),
            positions,
            (self.rotary.cos, self.rotary.sin),
            norms,
            layer_kv,
            slots,
            keep_k=keep_k,
        )


# From this many rows the MLP takes `gate_up_silu`, below it the projection (skinny.GATE_UP,
# then cuBLAS) and `silu_and_mul`. On an H100 the fused kernel was 4% faster at 2,048 rows,
# 6% slower at 512, within 2% from 33 to 256 rows (results/gpu_2026-11-27_s10/call3).
FUSED_MIN_ROWS = 1024


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, GATE_UP
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, DOWN)
        self.interleaved = 0  # gate_up's weight: [gate; up], or `interleave`d in blocks of this

    def after_load(self) -> None:
        """Where the fused gate/up kernel runs, interleave gate_up's weight for it (once)."""
        w = self.gate_up_proj.weight
        if not self.interleaved and fits_weight(w):
            w.data.copy_(interleave(w.data))
            self.interleaved = BLOCK

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        after: RMSNorm,
        reader: ColumnParallelLinear | None,
    ) -> torch.Tensor | Normed:
        """`after` of the MLP's output added to `residual` (updated in place), left to
        `reader` to apply where it can (`RowParallelLinear.add_norm`)."""
        if self.interleaved and x.dim() == 2 and x.shape[0] >= FUSED_MIN_ROWS:
            act = gate_up_silu(x, self.gate_up_proj.weight)
        else:
            act = silu_and_mul(self.gate_up_proj(x), self.interleaved)
        return self.down_proj.add_norm(act, residual, after, reader)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor | Normed,
        residual: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        after: RMSNorm,
        reader: ColumnParallelLinear | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """h is this layer's input norm of the residual stream `residual`. Returns (the
        norm `after` of the stream this layer adds to, for the projection `reader` that
        reads it next; that stream), of the rows `keep` only where given."""
        out = self.self_attn(h, positions, batch, attn)
        return self.finish(out, residual, after, reader, keep)

    def finish(
        self,
        out: torch.Tensor,
        residual: torch.Tensor,
        after: RMSNorm,
        reader: ColumnParallelLinear | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """The layer past its attention output `out` [T, Hq * D]: as `forward`."""
        h = self.self_attn.output(out, keep)
        residual = _rows(residual, keep)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h, residual, after, reader), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary


class CausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] for the token rows that are sampled.

        Past the last layer's attention only those rows matter: where they are fewer than
        the step's tokens (a prompt samples one row of thousands), that layer's o_proj
        and MLP compute them alone, about a thirtieth of a prompt's matmuls."""
        keep = logit_rows if logit_rows.numel() < input_ids.shape[0] else None
        h, residual = self.embed(input_ids)
        layers = self.model.layers
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            after, reader = self.after_layer(i)
            h, residual = layer(
                h, residual, positions, batch, attn, after, reader, keep if i == last else None
            )
        return self.logits(h, logit_rows, keep)

    def embed(
        self, input_ids: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """The first layer's input norm of the embedded tokens, and the residual stream
        (into `residual` where given: a CUDA graph's fixed buffer)."""
        x = self.model.embed_tokens(input_ids)
        if residual is None:
            residual = x.clone()
        else:
            residual.copy_(x)
        first = self.model.layers[0]
        assert isinstance(first, DecoderLayer)
        return first.input_layernorm(x), residual

    def after_layer(self, i: int) -> tuple[RMSNorm, ColumnParallelLinear | None]:
        """What reads layer i's output: the next layer's input norm and its q/k/v
        projection (which may apply the norm itself), or after the last layer the final
        norm, a kernel, for the LM head reads a tensor."""
        layers = self.model.layers
        if i == len(layers) - 1:
            return self.model.norm, None
        following = layers[i + 1]
        assert isinstance(following, DecoderLayer)
        return following.input_layernorm, following.self_attn.qkv_proj

    def logits(
        self, h: torch.Tensor | Normed, logit_rows: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits of the final norm `h`: of its rows `logit_rows`, or of all its rows where
        the last layer kept those alone (`keep`)."""
        assert isinstance(h, torch.Tensor)
        if keep is None:
            h = h[logit_rows]
        return self.lm_head.logits(h).float()

    def checkpoint_target(self, name: str) -> tuple[str, int] | None:
        """Map a checkpoint tensor name to (our parameter name, shard id); None for a name
        no checkpoint of these families has (our fused names are not theirs)."""
        for frag, (ours, shard) in self.stacked.items():
            if frag in name:
                return name.replace(frag, ours), shard
        if any(ours in name for ours, _ in self.stacked.values()):
            return None
        return name, 0

    def expected_shards(self) -> set[tuple[str, int]]:
        expected: set[tuple[str, int]] = set()
        for name, param in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            loader = getattr(param, "weight_loader", None)
            owner = getattr(loader, "__self__", None)
            n = len(owner.output_sizes) if isinstance(owner, ColumnParallelLinear) else 1
            expected.update((name, s) for s in range(n))
        return expected
