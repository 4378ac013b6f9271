"""Logging that a flood cannot turn into a flood of log lines.

`RateLimitedLog(logger).warning(fmt, *args)` logs at most one record per `interval`
seconds for each format string; the records held back in between are counted and the
count rides on the next record that goes out. Counters in metrics say how many events
there were; the log says that they happen and what one looks like. Thread-safe: the KV
planes call it from their own threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # format string -> when it was last logged
        self._held: dict[str, int] = {}  # format string -> records held back since

    def warning(self, fmt: str, *args: object) -> None:
        self.log(logging.WARNING, fmt, *args)

    def log(self, level: int, fmt: str, *args: object) -> None:
        now = self._clock()
        with self._lock:
            last = self._last.get(fmt)
            if last is not None and now - last < self._interval:
                self._held[fmt] = self._held.get(fmt, 0) + 1
                return
            self._last[fmt] = now
            held = self._held.pop(fmt, 0)
        if held:
            fmt += " (and %d more like it in the last %.0fs)"
            args = (*args, held, now - (last or now))
        self._logger.log(level, fmt, *args)
