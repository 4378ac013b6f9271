"""The KV pool: one tensor holding every layer's keys and values, page-major.

    buffer[page, layer, k|v, offset_in_page, kv_head, head_dim]

Page-major means page p is one contiguous byte range of `page_bytes`, holding that page's
keys and values for every layer. A request whose pages are consecutive is therefore a
single region for the KV transfer layer, however many layers the model has. A KV slot
(one token's position in the pool) is `page * page_size + offset`.
"""

from __future__ import annotations

import torch

from baton.common.devices import shared_host_zeros
from baton.common.layers.kernels import kv_store


class KVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        if self.device.type == "cpu":  # same-host peers can map it (KV transfer `ipc`)
            nbytes = (
                num_pages * page_size * self.token_bytes(num_layers, num_kv_heads, head_dim, dtype)
            )
            self.buffer = shared_host_zeros(nbytes).view(dtype).view(shape)
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        # made once: a view costs microseconds of host time, and every layer of every eager
        # step asks for one or more (4% of a mixed step's launch, py-spy, s30)
        self._layers = [self.buffer[:, layer] for layer in range(num_layers)]

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take in every layer."""
        return num_layers * 2 * num_kv_heads * head_dim * dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    @property
    def size_tokens(self) -> int:
        return self.num_pages * self.page_size

    def layer_kv(self, layer: int) -> torch.Tensor:
        """[num_pages, 2, page_size, kv_heads, head_dim] view of one layer (flashinfer's NHD)."""
        return self._layers[layer]

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) at KV slots ([T])."""
        kv = self._layers[layer]
        if kv_store(kv, slots, k, v, self.page_size):
            return
        pages, offsets = slots // self.page_size, slots % self.page_size
        kv[pages, 0, offsets] = k.to(self.dtype)
        kv[pages, 1, offsets] = v.to(self.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._layers[layer]
        if self.page_size == 1:
            both = kv[slots, :, 0]  # [T, 2, Hk, D]
        else:
            both = kv[slots // self.page_size, :, slots % self.page_size]
        return both[:, 0], both[:, 1]

    def check_integrity(self) -> None:
        assert self.buffer.is_contiguous(), "KV pool buffer must stay contiguous"
        assert self.buffer.shape[0] == self.num_pages
