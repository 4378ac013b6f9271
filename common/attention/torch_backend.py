"""Reference attention over the paged KV pool with torch ops (CPU and CUDA).

Decode steps gather every request's keys into one padded batch; extend steps loop over
requests. Correctness first: the triton and flashinfer backends are tested against this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.common.attention.base import AttentionBackend, ForwardBatch, NewKV


class TorchBackend(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        self._decode_slots: torch.Tensor | None = None
        if batch.is_decode:
            max_len = max(batch.seq_lens_list)
            rows = batch.req_to_token[batch.req_slots, :max_len]  # [B, S]
            ar = torch.arange(max_len, device=rows.device)
            self._decode_valid = ar[None, :] < batch.seq_lens[:, None]
            self._decode_slots = torch.where(self._decode_valid, rows, torch.zeros_like(rows))
        else:
            self._extend_slots = [
                batch.req_to_token[batch.req_slots[i], : batch.seq_lens_list[i]]
                for i in range(batch.batch_size)
            ]

    def attend(
        self, q: torch.Tensor, layer: int, batch: ForwardBatch, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        if self._decode_slots is not None:
            return self._decode(q, layer)
        return self._extend(q, layer, batch)

    def _decode(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        assert self._decode_slots is not None
        b, s = self._decode_slots.shape
        keys, values = self.pool.gather(layer, self._decode_slots.reshape(-1))
        keys = keys.view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, Hk, S, D]
        values = values.view(b, s, -1, self.head_dim).transpose(1, 2)
        mask = self._decode_valid[:, None, None, :]  # [B, 1, 1, S]
        out = _sdpa(q.unsqueeze(2), keys, values, mask, self.scale)  # q [B, Hq, 1, D]
        return out.squeeze(2)

    def _extend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, slots in enumerate(self._extend_slots):
            n, prefix = batch.extend_lens_list[i], batch.prefix_lens_list[i]
            keys, values = self.pool.gather(layer, slots)
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ki = keys.transpose(0, 1).unsqueeze(0)  # [1, Hk, S, D]
            vi = values.transpose(0, 1).unsqueeze(0)
            # query j sits at position prefix + j and sees keys 0 ..= prefix + j
            qpos = torch.arange(prefix, prefix + n, device=q.device)
            kpos = torch.arange(slots.numel(), device=q.device)
            mask = (kpos[None, :] <= qpos[:, None])[None, None]
            out[start : start + n] = _sdpa(qi, ki, vi, mask, self.scale)[0].transpose(0, 1)
            start += n
        return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
