"""Request-to-token table: (request slot, position) -> KV slot.

Each running request owns one row (a slot). Attention backends read rows of `table`
to find a request's keys and values in the KV pool.
"""

from __future__ import annotations

import torch

from baton.common.devices import to_device


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

    def write_many(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """Apply (row, start, kv slots) writes with one host-to-device copy."""
        rows = [slot for slot, _, values in writes for _ in values]
        cols = [start + i for _, start, values in writes for i in range(len(values))]
        vals = [v for _, _, values in writes for v in values]
        r, c, v = to_device([rows, cols, vals], self.table.device)
        self.table[r, c] = v

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.max_requests
        assert not (set(self._free) & self._used)
