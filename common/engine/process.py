"""Helpers for a process that serves one engine for its life: a worker's scheduler process
and each tensor-parallel follower. (Not in the engine itself: tests start many engines in
one process.)"""

from __future__ import annotations

import gc
import time


def freeze_heap() -> None:
    """For a process that serves one engine from now on: what exists lives as long as the
    engine, some 300,000 objects, which every full collection would scan (142 ms on a CPU;
    a decode loop at batch 128 on an H200 host stalled 157 ms in one, results/
    gpu_2026-11-27_s18). Out of the collector's sight: a full collection then takes under
    0.01 ms."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """The interpreter's garbage collections, (generation, seconds) each: those in a `with`
    block, or from `start()` on, taken in batches with `take()` (a worker's scheduler
    process reports them with its stats: a full collection stops every stream it runs)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started: list[float] = []

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            self.pauses.append((info["generation"], time.perf_counter() - self._started.pop()))

    def start(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def __enter__(self) -> GcPauses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def take(self) -> list[tuple[int, float]]:
        """The pauses recorded since the last take, and forget them."""
        out, self.pauses = self.pauses, []
        return out

    def summary(self) -> list[tuple[int, float]]:
        """(generation, ms) of each collection."""
        return [(g, round(d * 1e3, 2)) for g, d in self.pauses]
