"""KV events: which pages a worker's prefix cache stored and evicted, by content.

A page is named by a *page key*: a 64-bit hash chained over the previous page's key and
the page's token ids (full pages only), so a key names the whole prefix up to its page,
and the router computes the same keys for a prompt without asking anyone:

    key(page 0) = H(ROOT, tokens[0:p])      key(page i) = H(key(page i-1), tokens[i*p:(i+1)*p])

The radix cache (`cache/radix.py`) hashes a page once, as it enters the tree, and appends
a `PageEvent` to its log; evicting a page appends its keys again, no hashing. With a host
tier (`cache/tiered_radix.py`) a page evicted to the host is still held, at a lower value
(it must be loaded back): its keys go `to_host`, and `to_device` when it is loaded back or
recomputed; it is `removed` when it leaves the host too. A worker
ships the log as `KVEventBatch`es; `PageSet` is the one reader of events, kept by the
worker's frontend (to answer a subscriber with a snapshot) and by the router's index
(`services/router/kv_index.py`). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgspec

ROOT = 0  # the parent key of a prompt's first page; no page has it (page_keys avoids 0)
_U64 = (1 << 64) - 1  # keys are unsigned 64-bit (uint64 on the wire)


def page_keys(tokens: Sequence[int], page_size: int, parent: int = ROOT) -> list[int]:
    """Keys of the full pages of `tokens`, chained from `parent` (the key of the page
    before `tokens[0]`).

    H is CPython's tuple hash: for ints it is the same in every process (no hash seed) and
    every CPython since 3.8 on 64 bits (tests/unit/test_kv_events.py pins a value), and
    it costs ~0.1 us a token, where blake2b cost six times more at one token a page. It is
    no defence against crafted collisions, which could only mislead routing: a worker
    matches prompts by their tokens."""
    keys = []
    end = len(tokens) - len(tokens) % page_size
    if page_size == 1:  # the same keys, without slicing a tuple per token
        for token in tokens:
            parent = hash((parent, token)) & _U64 or 1
            keys.append(parent)
        return keys
    for i in range(0, end, page_size):
        parent = hash((parent, *tokens[i : i + page_size])) & _U64 or 1
        keys.append(parent)
    return keys


class PageEvent(msgspec.Struct, array_like=True):
    """One change of a cache: `stored` pages, a chain under the page `parent` (ROOT for a
    prompt's first page, on the device), `removed` pages, or pages held that moved to the
    host tier (`to_host`) or back to the device (`to_device`). One list is not empty."""

    parent: int = ROOT
    stored: list[int] = []
    removed: list[int] = []
    to_host: list[int] = []
    to_device: list[int] = []


class KVEventBatch(msgspec.Struct):
    """Changes of one worker's cache, in order, as the frontend ships them.

    `seq` counts a worker incarnation's batches from 1. A snapshot is one or more batches
    of `seq` S: the first `reset` (forget the worker's pages first), the last `complete`
    (the pages applied so far are the cache as of S). A batch of events is `complete`
    with seq S+1 after S. A batch with no events repeating the last seq is a keepalive."""

    incarnation: str
    seq: int
    created_at: float  # time.time() on the worker when the events happened
    page_size: int
    events: list[PageEvent] = []
    reset: bool = False
    complete: bool = True
    found_tokens: int = 0  # sum of cached_tokens in the worker's finished responses


class InconsistentEvents(ValueError):
    """Events that do not fit the pages known: the reader has lost sync."""


class PageSet:
    """A worker's cached page keys, each with its parent's, and which of them are on the
    host tier: what its events add up to."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self._host: set[int] = set()

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: int) -> bool:
        return key in self._parent

    def apply(self, events: Iterable[PageEvent]) -> None:
        """Raises InconsistentEvents for a chain under an unknown page, or the removal or
        move of a page not held (the set is then partly updated: resync)."""
        for event in events:
            parent = event.parent
            if event.stored and parent != ROOT and parent not in self._parent:
                raise InconsistentEvents(f"pages stored under unknown page {parent:#x}")
            for key in event.stored:
                self._parent[key] = parent
                self._host.discard(key)
                parent = key
            for key in event.removed:
                if self._parent.pop(key, None) is None:
                    raise InconsistentEvents(f"removal of unknown page {key:#x}")
                self._host.discard(key)
            for keys, to_host in ((event.to_host, True), (event.to_device, False)):
                for key in keys:
                    if key not in self._parent:
                        raise InconsistentEvents(f"move of unknown page {key:#x}")
                    if to_host:
                        self._host.add(key)
                    else:
                        self._host.discard(key)

    def clear(self) -> None:
        self._parent.clear()
        self._host.clear()

    @property
    def host_pages(self) -> int:
        """How many of the pages are on the host tier."""
        return len(self._host)

    def matched_tiers(self, keys: Sequence[int]) -> tuple[int, int]:
        """Leading keys of a prompt's `keys` held: (on the device, on the host). A cache
        keeps no device page below a host page, so the device ones come first."""
        device = host = 0
        for key in keys:
            if key not in self._parent:
                break
            if key in self._host:
                host += 1
            else:
                device += 1
        return device, host

    def snapshot(self, max_pages: int) -> Iterator[list[PageEvent]]:
        """Every page as stored chains, in parts of at most `max_pages` pages, then the
        host tier's as moves `to_host`. Pages were stored chain by chain and a dict keeps
        that order, so consecutive keys mostly extend one chain."""
        part: list[PageEvent] = []
        pages = 0
        last = None
        for key, parent in self._parent.items():
            if last is not None and parent == last.stored[-1] and pages < max_pages:
                last.stored.append(key)
            else:
                if pages >= max_pages:
                    yield part
                    part, pages = [], 0
                last = PageEvent(parent, [key])
                part.append(last)
            pages += 1
        if part:
            yield part
        host = list(self._host)
        for i in range(0, len(host), max_pages):
            yield [PageEvent(to_host=host[i : i + max_pages])]
