"""Linear layers that know how tensor parallelism splits them.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies this rank's
slice of a checkpoint tensor into it, asserting the shapes; the model loader only routes
checkpoint names to parameters. Column-parallel layers split the output dimension,
row-parallel layers split the input dimension and all-reduce their output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from baton.common.distributed import tp
from baton.common.layers.norm import RMSNorm
from baton.common.layers.skinny import (
    LM_HEAD,
    Normed,
    Projection,
    small_batch_add_norm,
    small_batch_linear,
)


def _divide(n: int, k: int, what: str) -> int:
    if n % k:
        raise ValueError(f"{what} ({n}) is not divisible by tp_size ({k})")
    return n // k


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}"
        )
    dst.data.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W split by output rows. Fused layers list their sub-outputs in
    `output_sizes` (full, unsplit sizes); a checkpoint tensor for sub-output i is `shard_id` i.
    Small batches take `skinny`'s kernel where there is no bias."""

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, skinny: Projection
    ) -> None:
        super().__init__()
        g = tp()
        self.skinny = skinny
        self.output_sizes = list(output_sizes)
        self.local_sizes = [_divide(s, g.size, "output size") for s in output_sizes]
        self.weight = nn.Parameter(
            torch.empty(sum(self.local_sizes), in_features), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None
        )
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int, name: str) -> None:
        g = tp()
        full, local = self.output_sizes[shard_id], self.local_sizes[shard_id]
        if loaded.shape[0] != full:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(loaded.shape)}, expected first dim {full}"
            )
        start = sum(self.local_sizes[:shard_id])
        copy_checked(
            param.data.narrow(0, start, local), loaded.narrow(0, g.rank * local, local), name
        )

    def reads_normed(self, x: torch.Tensor) -> bool:
        """Whether this layer applies a norm itself as it reads rows like x."""
        return self.bias is None and x.shape[0] <= self.skinny.normed_rows

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        if self.bias is None:
            return small_batch_linear(x, self.weight, self.skinny)
        return F.linear(x.applied() if isinstance(x, Normed) else x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T, W split by input columns; partial sums are all-reduced. Small batches take
    `skinny`'s kernel."""

    def __init__(
        self, in_features: int, out_features: int, skinny: Projection, bias: bool = False
    ) -> None:
        super().__init__()
        self.skinny = skinny
        self.local_in = _divide(in_features, tp().size, "input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int, name: str) -> None:
        copy_checked(param.data, loaded.narrow(1, tp().rank * self.local_in, self.local_in), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp().all_reduce(small_batch_linear(x, self.weight, self.skinny))
        return y if self.bias is None else y + self.bias

    def add_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        reader: ColumnParallelLinear | None = None,
    ) -> torch.Tensor | Normed:
        """norm(x Wᵀ + residual), with `residual` updated in place to that sum. Where the
        small-batch kernel takes x without tensor parallelism and `reader`, the projection
        that reads the norm next, applies a norm itself at these rows, this kernel adds
        and `reader` applies the norm (`skinny.Normed`): no norm kernel runs between."""
        if tp().size == 1 and self.bias is None and reader is not None and reader.reads_normed(x):
            normed = small_batch_add_norm(
                x, self.weight, self.skinny, residual, (norm.weight, norm.eps)
            )
            if normed is not None:
                return normed
        return norm(self(x), residual)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; each rank looks up its range, then all-reduce."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        g = tp()
        self.vocab_size = vocab_size
        self.local_vocab = (vocab_size + g.size - 1) // g.size
        self.start = g.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, dim), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int, name: str) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(loaded.shape)} != "
                f"expected {(self.vocab_size, param.shape[1])}"
            )
        n = min(self.local_vocab, self.vocab_size - self.start)
        param.data.zero_()
        param.data[:n].copy_(loaded[self.start : self.start + n])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0.0)
        return tp().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary: each rank scores its rows, then all-gather."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = small_batch_linear(hidden, self.weight, LM_HEAD)
        full = tp().all_gather_last_dim(local)
        return full[..., : self.vocab_size]
