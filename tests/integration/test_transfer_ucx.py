"""The ucx backend's own data plane: hostile tag messages are dropped, serving goes on."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.messages import DataHello, RegionBatch, RegionFrame, encode_frame
from baton.common.transfer.testing import (
    backend_unusable,
    kv_buffer,
    manager_pair,
    wait_for,
    wait_terminal,
)

REASON = backend_unusable("ucx")
pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def send_raw(address: str, messages: list[bytes | tuple[bytes, int]]) -> None:
    """Send each message (to D's header tag unless a tag is given) from a worker of ours."""
    import ucxx._lib.libucxx as ucx
    from ucxx._lib.arr import Array

    from baton.common.transfer.ucx import HEADER_TAG

    context = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG,))
    worker = ucx.UCXWorker(context)
    remote = ucx.UCXAddress.create_from_buffer(
        np.frombuffer(bytes.fromhex(address.removeprefix("ucx:")), np.uint8)
    )
    endpoint = ucx.UCXEndpoint.create_from_worker_address(worker, remote, True)
    tagged = [m if isinstance(m, tuple) else (m, HEADER_TAG) for m in messages]
    buffers = [(Array(np.frombuffer(m, np.uint8).copy()), tag) for m, tag in tagged]
    requests = [endpoint.tag_send(b, ucx.UCXXTag(tag)) for b, tag in buffers]
    end = time.monotonic() + 5
    while not all(r.completed for r in requests) and time.monotonic() < end:
        worker.progress()
    endpoint.close_blocking(10**9, 1)


def test_hostile_header_messages_are_dropped() -> None:
    src, page_bytes = kv_buffer(16, 4, seed=5)
    dst, _ = kv_buffer(16, 4, seed=None)
    deadlines = Deadlines(5, 5, 5)
    with manager_pair("ucx", src, dst, page_bytes, deadlines=deadlines, token="t") as (p, d):
        assert d.transfer_address is not None
        receiver = d.create_receiver(3, p.control_address)
        receiver.init([4, 5])
        send_raw(
            d.transfer_address,
            [
                os.urandom(100),
                os.urandom(1 << 20),  # larger than a header slot: truncated by UCX
                encode_frame(DataHello(token="wrong", peer="x:1", conn=77)),
                encode_frame(RegionFrame(room=3, dst_offset=4 * page_bytes, length=page_bytes)),
                encode_frame(RegionBatch(5, [RegionFrame(3, 4 * page_bytes, page_bytes)])),
            ],
        )
        assert wait_for(lambda: d.stats().get("frames_dropped", 0) >= 5)
        assert not dst.view(-1).view(torch.uint8).any()  # the region without a hello

        # Authenticated, but for a room that does not exist / outside the room's pages.
        hello = encode_frame(DataHello(token="t", peer=p.control_address, conn=78))
        stray = RegionFrame(room=999, dst_offset=0, length=page_bytes, tag=1 << 63 | 5)
        outside = RegionFrame(room=3, dst_offset=0, length=page_bytes, tag=1 << 63 | 6)
        payload = b"\xee" * page_bytes
        send_raw(
            d.transfer_address,
            [
                hello,
                encode_frame(RegionBatch(78, [stray])),
                (payload, stray.tag),
                encode_frame(RegionBatch(78, [outside])),
                (payload, outside.tag),
            ],
        )
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
        assert receiver.failure_reason == "write outside the room's pages"
        assert not dst.view(-1).view(torch.uint8).any()
        receiver.release()

        receiver = d.create_receiver(4, p.control_address)
        receiver.init([4, 5])

        sender = p.create_sender(4, d.control_address)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send([0, 1], 0)
        sender.finish(b"ok")
        assert wait_terminal([receiver, sender]) == [KVPoll.Success, KVPoll.Success]
        assert receiver.aux == b"ok"
