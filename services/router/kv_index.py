"""The router's exact view of every worker's prefix cache, from the workers' KV events.

Each worker followed (`kv_subscriber.py`) has a `PageSet`: the page keys its radix cache
holds, each with its parent's (`common/kv_events.py`). `KVIndex.match(tokens)` hashes the
prompt's full pages once per page size and answers, for every worker whose stream is
*fresh*, the prefix that worker would reuse: its cached full pages of the prompt less the
last token, which a worker always computes (for the next token's logits), exactly as its
`CacheManager` matches. Pages a worker holds on its host tier count at `HOST_HIT_VALUE` of
a device page's tokens (`match_tiers` tells the two apart). A stream is fresh while it is
synced (a snapshot, then every batch in sequence), connected, heard from within
`SILENCE_S` (workers send a keepalive every second), and its last batch arrived within
`max_lag_s` of being made. A batch's lag is read on two clocks, the worker's and the
router's: their offset (and the network's delay) is measured on the snapshot and
keepalives, which the worker stamps as it sends them, and taken out, so hosts whose clocks
disagree still agree on what is late.

`CombinedIndex` is what routing reads: the exact answer for fresh workers, the approximate
`PrefixTree`'s for the others (events off, lagging, after a gap, before the first
snapshot). Both offer `PrefixIndex.match`, one interface for policies and placement.

Memory: a page set mirrors a cache, so it is bounded by that worker's pool; one that grows
past `max_pages` is dropped and resynced. A worker that leaves is forgotten.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from baton.common.kv_events import InconsistentEvents, KVEventBatch, PageSet, page_keys

if TYPE_CHECKING:
    from baton.services.router.metrics import RouterMetrics

SILENCE_S = 5.0  # a stream silent this long is not trusted (keepalives come every second)
# A host-tier hit saves the prefill's compute but costs a load from host memory before the
# step. Measured (`benchmarks/lab/gpu_host_hit.py`, H200, 8B shape, page 1, 2026-11-28): a
# host hit keeps 0.90-0.95 of a device hit's saving of time to first token (prefixes of 1k
# to 12k tokens, suffixes of 256 and 2,048: loading 12k tokens' KV, 1.5 GiB at ~50 GB/s,
# takes 31 ms where computing them takes 308); the least of those.
HOST_HIT_VALUE = 0.9


class PrefixIndex(Protocol):
    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """worker_id -> tokens of `tokens`' prefix that worker is believed to hold (workers
        holding none may be left out)."""
        ...


@dataclass
class _Stream:
    """One worker's page set and the state of its event stream."""

    role: str
    pages: PageSet = field(default_factory=PageSet)
    page_size: int = 0
    incarnation: str = ""
    seq: int = 0  # the last batch applied
    synced: bool = False  # the pages are the worker's cache as of seq
    loading: bool = False  # inside a snapshot
    connected: bool = False
    heard: float = -math.inf  # monotonic time of the last message
    lag: float = math.inf  # seconds, of the last batch
    clock_offset: float = 0.0  # router's wall clock - worker's, plus the network's delay
    found_tokens: int = 0  # the worker's count, as last reported


class KVIndex:
    def __init__(
        self,
        max_lag_s: float = 1.0,
        max_pages: int = 1 << 21,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_lag_s = max_lag_s
        self.max_pages = max_pages
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._streams: dict[str, _Stream] = {}

    # -- the streams -------------------------------------------------------------------
    def track(self, worker_id: str, role: str) -> None:
        """Start indexing `worker_id` (nothing is known until its first snapshot)."""
        self._streams.setdefault(worker_id, _Stream(role))

    def forget(self, worker_id: str) -> None:
        self._streams.pop(worker_id, None)

    def resume_from(self, worker_id: str) -> tuple[str, int]:
        """(incarnation, first seq wanted) for a new subscription: the batch after the
        last applied while in sync, else 0 (a snapshot)."""
        s = self._streams.get(worker_id)
        if s is None or not s.synced:
            return "", 0
        return s.incarnation, s.seq + 1

    def disconnected(self, worker_id: str) -> None:
        s = self._streams.get(worker_id)
        if s is not None:
            s.connected = False

    def apply(self, worker_id: str, batch: KVEventBatch) -> bool:
        """Apply one batch of `worker_id`'s stream. False: the index lost sync with the
        worker (a gap, a new incarnation, events that do not fit); the caller subscribes
        again from `resume_from`, which then asks for a snapshot."""
        s = self._streams.get(worker_id)
        if s is None:
            return False
        s.connected = True
        s.heard = self._clock()
        age = self._wall_clock() - batch.created_at
        if batch.reset or (batch.seq == s.seq and not batch.events):
            s.clock_offset = age  # stamped as sent: all of its age is offset and network
        lag = max(0.0, age - s.clock_offset)
        if batch.reset:
            if batch.incarnation != s.incarnation:
                s.found_tokens = batch.found_tokens  # counted from here on
            s.pages.clear()
            s.incarnation, s.seq, s.page_size = batch.incarnation, batch.seq, batch.page_size
            s.synced, s.loading = False, True
        elif batch.incarnation != s.incarnation:
            return self._lost(s, "incarnation")
        elif s.loading:
            if batch.seq != s.seq:
                return self._lost(s, "gap")
        elif s.synced and batch.seq == s.seq and not batch.events:
            s.lag = lag  # a keepalive
            self._count_found(s, batch)
            return True
        elif not s.synced or batch.seq != s.seq + 1:
            return self._lost(s, "gap")
        try:
            s.pages.apply(batch.events)
        except InconsistentEvents:
            return self._lost(s, "inconsistent")
        if len(s.pages) > self.max_pages:
            s.pages.clear()
            return self._lost(s, "overflow")
        s.seq, s.lag = batch.seq, lag
        if batch.complete:
            s.synced, s.loading = True, False
        self._count_found(s, batch)
        if self._metrics is not None:
            self._metrics.kv_event_lag.observe(lag)
            self._metrics.kv_events_applied.inc(len(batch.events))
        return True

    def _lost(self, s: _Stream, reason: str) -> bool:
        s.synced = s.loading = False
        if self._metrics is not None:
            self._metrics.kv_resyncs.labels(reason).inc()
        return False

    def _count_found(self, s: _Stream, batch: KVEventBatch) -> None:
        found, s.found_tokens = batch.found_tokens - s.found_tokens, batch.found_tokens
        if found > 0 and self._metrics is not None:
            self._metrics.kv_hit_tokens_found.labels(s.role).inc(found)

    # -- reading -----------------------------------------------------------------------
    def fresh(self, worker_id: str) -> bool:
        s = self._streams.get(worker_id)
        return s is not None and self._fresh(s, self._clock())

    def _fresh(self, s: _Stream, now: float) -> bool:
        return s.synced and s.connected and now - s.heard <= SILENCE_S and s.lag <= self.max_lag_s

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """worker_id -> prefix of `tokens` it would reuse, for every fresh worker (0 for
        those holding none), its host-tier tokens counted at `HOST_HIT_VALUE`."""
        return valued(self.match_tiers(tokens))

    def match_tiers(self, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
        """worker_id -> (tokens of the prefix it would reuse from its device, then from
        its host tier), for every fresh worker."""
        now = self._clock()
        reusable = tokens[: len(tokens) - 1]
        keys: dict[int, list[int]] = {}  # by page size: a prompt is hashed once per size
        matched = {}
        for worker_id, s in self._streams.items():
            if not self._fresh(s, now):
                continue
            if s.page_size not in keys:
                keys[s.page_size] = page_keys(reusable, s.page_size)
            device, host = s.pages.matched_tiers(keys[s.page_size])
            matched[worker_id] = (device * s.page_size, host * s.page_size)
        return matched

    def note_prediction(self, worker_id: str, tokens: int) -> None:
        """Routing chose `worker_id` expecting it to reuse `tokens` of the prompt, from
        either tier, each token counted once (against what the worker reports it found,
        for the workers followed)."""
        s = self._streams.get(worker_id)
        if s is not None and self._metrics is not None and tokens > 0:
            self._metrics.kv_hit_tokens_predicted.labels(s.role).inc(tokens)

    def sizes(self) -> dict[str, int]:
        """Pages indexed per worker."""
        return {worker_id: len(s.pages) for worker_id, s in self._streams.items()}

    def host_sizes(self) -> dict[str, int]:
        """Pages indexed per worker that are on its host tier."""
        return {worker_id: s.pages.host_pages for worker_id, s in self._streams.items()}


def valued(tiers: dict[str, tuple[int, int]]) -> dict[str, int]:
    """worker_id -> its (device, host) prefix tokens as one worth, the host's at
    `HOST_HIT_VALUE`."""
    return {
        worker_id: device + int(HOST_HIT_VALUE * host)
        for worker_id, (device, host) in tiers.items()
    }


class CombinedIndex:
    """The exact index where a worker's events are fresh, the approximate one elsewhere."""

    def __init__(self, exact: KVIndex, approximate: PrefixIndex) -> None:
        self.exact = exact
        self.approximate = approximate

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        return valued(self.match_tiers(tokens))

    def match_tiers(self, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
        """worker_id -> (device, host) prefix tokens; the approximate tree's guesses count
        as device tokens (it does not know tiers). Workers holding none are left out."""
        matched = {worker_id: (n, 0) for worker_id, n in self.approximate.match(tokens).items()}
        matched.update(self.exact.match_tiers(tokens))
        return {worker_id: t for worker_id, t in matched.items() if t[0] + t[1] > 0}
