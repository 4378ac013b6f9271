"""A doorbell rung by a GPU copy stream (see transfer/doorbell): queuing the ring does not
wait for the GPU, and the slot shows the room id only after the copies queued before it
ran, so D may read the pages the moment it sees it."""

from __future__ import annotations

import os
import time

import pytest
import torch

from baton.common.transfer.doorbell import BellMapping, Doorbells

ROOM = (1 << 62) | 12345  # a 63-bit odd id, as the router's


@pytest.mark.timeout(120)
def test_the_copy_stream_rings_after_the_copies_and_the_host_does_not_wait() -> None:
    bells = Doorbells(slots=16)
    device = torch.device("cuda", 0)
    mapping = BellMapping(os.getpid(), bells.fd, bells.slots, device)
    assert mapping.launches, "the slots could not be registered with CUDA"
    slot = bells.allocate()
    src = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    copies = torch.cuda.Stream(device)
    gate = torch.cuda.Event()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the copy may start
        gate.record()
    copies.wait_event(gate)
    began = time.perf_counter()
    with torch.cuda.stream(copies):
        dst.copy_(src, non_blocking=True)
    mapping.launch_ring(slot, ROOM, copies)
    queued_s = time.perf_counter() - began
    assert not bells.rung(slot, ROOM)  # the GPU is still asleep: nothing landed yet
    assert queued_s < 0.02, f"queuing the ring took {queued_s * 1e3:.1f} ms"
    deadline = time.monotonic() + 10
    while not bells.rung(slot, ROOM):
        assert time.monotonic() < deadline, "the bell never rang"
        time.sleep(1e-4)
    # Seen from the host right at the ring: every byte before it already landed (no sync).
    check = torch.cuda.Stream(device)
    with torch.cuda.stream(check):
        equal = bool(torch.equal(dst, src))
    assert equal
    mapping.close()


@pytest.mark.timeout(60)
def test_a_failed_host_registration_does_not_fail_the_next_kernel() -> None:
    """CUDA keeps a failed call's error as the thread's last one, and torch's next launch
    check reads it as its own: a KV copy failed with "already mapped" after a doorbell
    could not be registered (H200, a role flip under load). `cuda_host_register` drops it."""
    from baton.common.devices import cuda_host_register

    cudart = torch.cuda.cudart()
    host = torch.zeros(4096, dtype=torch.uint8)
    src = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
    assert cuda_host_register(host.data_ptr(), host.numel()) == ""
    try:
        # the hazard: registered already, the raw call fails and the next kernel reports it
        assert cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0) != 0
        with pytest.raises(RuntimeError, match="already"):
            src.mul(2)
            torch.cuda.synchronize()
        # through cuda_host_register the failure is told, and the next kernel runs
        assert cuda_host_register(host.data_ptr(), host.numel()) != ""
        doubled = src.mul(2)
        torch.cuda.synchronize()
        assert int(doubled[0]) == 2
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


@pytest.mark.timeout(60)
def test_a_mapping_dropped_unclosed_leaves_no_registration_behind() -> None:
    """The next mapping of the slots (often at the same address) registers again."""
    import gc

    bells = Doorbells(slots=16)
    device = torch.device("cuda", 0)
    for _ in range(4):
        mapping = BellMapping(os.getpid(), bells.fd, bells.slots, device)
        assert mapping.launches, "the slots could not be registered with CUDA"
        del mapping  # not closed
        gc.collect()
