"""What a client sees of a migration: the gaps between a generation's outputs.

From its first move on (`migrated`), a generation measures the longest gap between two
outputs it passes on, and the cutover: from the old worker's last output to the new
worker's first (before any output, from the request's arrival). The router observes them
as `baton_router_migration_stall_seconds` and `..._cutover_seconds` (issue #41's "longest
stall between tokens of a migrated stream")."""

from __future__ import annotations

import time

__all__ = ["StreamGaps"]


class StreamGaps:
    def __init__(self) -> None:
        self.longest: float | None = None  # between outputs, once migrated
        self._last_output = 0.0  # time.monotonic() of the last output passed on
        self._cutover_from: float | None = None  # the old worker's last output, while moving

    def passed(self) -> float | None:
        """An output was passed on now: the cutover's seconds when it is the first since a
        move, else None."""
        now = time.monotonic()
        cutover = None
        if self._cutover_from is not None:
            cutover, self._cutover_from = now - self._cutover_from, None
        if self.longest is not None:
            self.longest = max(self.longest, now - self._last_output)
        self._last_output = now
        return cutover

    def migrated(self, any_passed: bool, arrival: float) -> None:
        """The stream continues on another worker: from here its longest gap is measured,
        and its cutover up to the new worker's first output."""
        if any_passed:
            self._cutover_from = self._last_output
        if self.longest is None:
            self.longest = 0.0
            if not any_passed:  # (a move before any output: from the request's arrival)
                self._last_output = arrival
