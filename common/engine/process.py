"""Helpers for a process that serves for its life once it is up: a worker's scheduler
process and each tensor-parallel follower (one engine each), a worker's frontend, the
router. (Not in the engine itself: tests start many engines in one process.)"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

FULL_COLLECTION_AFTER = 100  # collections of the middle generation (the default: 10)
# The histogram buckets of a process's collection pauses (the router's, a worker's), seconds
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def freeze_heap() -> None:
    """For a process that serves from now on: what exists lives as long as the process,
    its modules, model and tokenizer: a scheduler process's some 300,000 objects, which
    every full collection would scan (142 ms on a CPU; a decode loop at batch 128 on an
    H200 host stalled 157 ms in one, results/gpu_2026-11-27_s18); the router's 266,000
    (163 ms on the development machine) and a worker frontend's 61,000 (33 ms), while every
    stream they relay waits. Out of the collector's sight: a full collection then takes
    under 0.01 ms. And full collections come ten times rarer than the interpreter's default (after
    100 collections of the middle generation, not 10): what lives on after the freeze is the
    running requests' state, whose token lists a full collection walks item by item (a
    worker at batch 200 of ~1,700 tokens on an H200 host: 10 full collections of ~25 ms in
    a 25 s burst); cyclic garbage waits longer, the young generations are collected as
    often as before."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)


class GcPauses:
    """The interpreter's garbage collections, (generation, seconds) each: those in a `with`
    block, or from `start()` on, taken in batches with `take()` (a worker's scheduler
    process reports them with its stats: a full collection stops every stream it runs).
    With `on_pause`, each goes to it instead of the list (the router counts them as they
    come; the callback runs inside the collection and must take no lock)."""

    def __init__(self, on_pause: Callable[[int, float], None] | None = None) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._on_pause = on_pause
        self._started: list[float] = []

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            pause = (info["generation"], time.perf_counter() - self._started.pop())
            if self._on_pause is None:
                self.pauses.append(pause)
            else:
                self._on_pause(*pause)

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
