"""KV pages really move: a prefill manager and a decode manager in one process, two tensors,
for each data-plane backend (loopback sockets; ipc: P writes into D's memfd pool)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.testing import backend_unusable, kv_buffer, manager_pair, wait_for

pytestmark = pytest.mark.timeout(60)

DEADLINES = Deadlines(bootstrap_s=5, waiting_s=5, transferring_s=10)
NUM_PAGES = 96


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes make NaNs, which never equal themselves)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def runs(pairs: list[tuple[int, int]]) -> int:
    """Maximal runs contiguous on both sides (the fewest regions that can carry pairs)."""
    members = set(pairs)
    return sum((s - 1, d - 1) not in members for s, d in members)


def backend_param(name: str) -> pytest.param:  # type: ignore[valid-type]
    reason = backend_unusable(name) if name == "ucx" else None
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


BACKENDS = [backend_param(name) for name in ("tcp", "ucx", "ipc", "auto")]


def plan_rooms(rng: random.Random, count: int) -> list[dict]:
    """Rooms with destination pages from one free list of shuffled 4-page blocks (runs and
    breaks, as an allocator gives out), source pages contiguous or random, random prefixes
    and chunking."""
    blocks = [list(range(b, b + 4)) for b in range(0, NUM_PAGES, 4)]
    rng.shuffle(blocks)
    free_dst = [page for block in blocks for page in block]
    rooms = []
    for index in range(count):
        n = rng.randint(1, 10)
        dst, free_dst = free_dst[:n], free_dst[n:]
        start = rng.randrange(NUM_PAGES - n)
        src = list(range(start, start + n)) if index % 2 else rng.sample(range(NUM_PAGES), n)
        cuts = []  # every third room is sent in one go: its region count is exact
        if index % 3 and n > 1:
            cuts = sorted(rng.sample(range(1, n), rng.randint(1, min(3, n - 1))))
        rooms.append(
            {
                "room": rng.getrandbits(63),
                "src": src,
                "dst": dst,
                "prefix": rng.randint(0, 3),
                "chunks": [0, *cuts, n],
            }
        )
    return rooms


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_land_where_decode_asked_and_nowhere_else(backend: str, page_size: int) -> None:
    rng = random.Random(page_size)
    src, page_bytes = kv_buffer(NUM_PAGES, page_size, seed=1)
    dst, _ = kv_buffer(NUM_PAGES, page_size, seed=2)
    before = dst.clone()
    rooms = plan_rooms(rng, count=6)
    with manager_pair(backend, src, dst, page_bytes, deadlines=DEADLINES, token="t") as (p, d):
        receivers, senders = [], []
        for spec in rooms:
            receiver = d.create_receiver(spec["room"], p.control_address)
            receiver.init(spec["dst"], prefix_pages=spec["prefix"])
            receivers.append(receiver)
        for spec in rooms:
            senders.append(p.create_sender(spec["room"], d.control_address))
        assert wait_for(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders))
        for spec, sender in zip(rooms, senders, strict=True):
            assert sender.num_dst_pages == len(spec["dst"])
            assert sender.prefix_pages == spec["prefix"]
            chunks = spec["chunks"]
            for a, b in itertools.pairwise(chunks):  # one send per prefill chunk
                sender.send(spec["src"][a:b], dst_start=a)
            sender.finish(aux=b"first-token-%d" % spec["room"])
        assert wait_for(lambda: all(r.poll().terminal for r in receivers + senders))

        for spec, sender, receiver in zip(rooms, senders, receivers, strict=True):
            assert receiver.poll() == KVPoll.Success, receiver.failure_reason
            assert sender.poll() == KVPoll.Success, sender.failure_reason
            assert receiver.aux == b"first-token-%d" % spec["room"]
            assert same(dst[spec["dst"]], src[spec["src"]])
            pairs = list(zip(spec["src"], spec["dst"], strict=True))
            chunks = spec["chunks"]
            per_chunk = sum(runs(pairs[a:b]) for a, b in itertools.pairwise(chunks))
            # Chunks queued together coalesce; each chunk alone gives the upper bound.
            assert runs(pairs) <= sender.regions <= per_chunk
            if len(chunks) == 2:
                assert sender.regions == runs(pairs)
            assert receiver.regions == sender.regions
        # each side names the backend that carried the pages (auto: the one it chose)
        used = {s.backend for s in senders} | {r.backend for r in receivers}
        assert used == {"ipc" if backend == "auto" else backend}

        touched = {page for spec in rooms for page in spec["dst"]}
        untouched = [page for page in range(NUM_PAGES) if page not in touched]
        assert same(dst[untouched], before[untouched])

        sent, received = p.stats(), d.stats()
        total_pages = sum(len(spec["dst"]) for spec in rooms)
        assert sent["pages_sent"] == received["pages_received"] == total_pages
        assert sent["bytes_sent"] == received["bytes_received"] == total_pages * page_bytes
        assert sent["regions_sent"] == sum(s.regions for s in senders)
        assert sent["rooms_ok"] == received["rooms_ok"] == len(rooms)
        assert received["rooms_failed"] == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_fully_cached_on_decode_moves_no_pages(backend: str) -> None:
    src, page_bytes = kv_buffer(8, 4)
    dst, _ = kv_buffer(8, 4, seed=None)
    with manager_pair(backend, src, dst, page_bytes, deadlines=DEADLINES) as (p, d):
        receiver = d.create_receiver(1, p.control_address)
        receiver.init([], prefix_pages=3)
        sender = p.create_sender(1, d.control_address)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.finish(b"tok")
        assert wait_for(lambda: receiver.poll() == KVPoll.Success)
        assert receiver.aux == b"tok" and sender.regions == 0
        assert not dst.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_verify_clean_transfers(backend: str) -> None:
    src, page_bytes = kv_buffer(16, 4)
    dst, _ = kv_buffer(16, 4, seed=None)
    with manager_pair(backend, src, dst, page_bytes, deadlines=DEADLINES, verify_checksum=True) as (
        p,
        d,
    ):
        receiver = d.create_receiver(9, p.control_address)
        receiver.init([5, 6, 7, 1])
        sender = p.create_sender(9, d.control_address)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send([0, 1, 2, 3], 0)
        sender.finish(b"")
        assert wait_for(lambda: receiver.poll().terminal)
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        assert same(dst[[5, 6, 7, 1]], src[[0, 1, 2, 3]])
