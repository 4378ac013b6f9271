"""Request-to-token table: (request slot, position) -> KV slot.

Each running request owns one row (a slot). Attention backends read rows of `table`
to find a request's keys and values in the KV pool.
"""

from __future__ import annotations

import numpy as np
import torch

from baton.common.devices import Ints, flat_array, upload


class ReqToTokenTable:
    def __init__(self, max_requests: int, max_context: int, device: torch.device | str) -> None:
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self._free = list(range(max_requests - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"request slot {slot} freed twice")
        self._used.remove(slot)
        self._free.append(slot)

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        self.table[slot, start : start + kv_slots.numel()] = kv_slots

    def write_many(self, writes: list[tuple[int, int, Ints]]) -> None:
        """Apply (row, start, kv slots) writes with one host-to-device copy: each value's
        cell of the flattened table, then the values (numpy builds the cells: a prompt's
        write has thousands)."""
        if not writes:
            return
        lens = np.fromiter((len(values) for _, _, values in writes), np.int64, len(writes))
        first = np.fromiter(
            (row * self.max_context + start for row, start, _ in writes), np.int64, len(writes)
        )
        n = int(lens.sum())
        # a value's cell: its write's first cell, plus its index in the step less the
        # write's first index in the step
        cells = np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(n)
        vals = flat_array([values for _, _, values in writes], torch.int64)
        both = upload(torch.from_numpy(np.concatenate([cells, vals])), self.table.device)
        self.table.view(-1)[both[:n]] = both[n:]

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.max_requests
        assert not (set(self._free) & self._used)
