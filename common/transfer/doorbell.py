"""Doorbells: how D learns that P's direct writes landed without a message (same host).

With the `ipc` backend P writes a room's pages straight into D's pool. The final status
used to leave only after the copies finished, and then crossed three threads (P's transfer
thread waking, ZMQ's I/O threads on both sides, D's control thread): about 0.9 ms of a
1.1 ms handoff on an H100. With a doorbell:

- D exports a small array of int64 slots in shared host memory (a memfd) next to its pool,
  and gives each room a slot in its init (``KVInit.bell``), zeroed.
- At ``finish`` P sends the final status at once (``KVDone.landed`` False): it travels while
  the copies run. Then it rings: on a GPU the copy stream itself writes the room id into the
  slot, queued behind the room's copies; on the CPU the transfer thread stores it once its
  copies returned.
- D's room succeeds when the status has arrived and its slot holds the room id, which
  ``poll`` reads from memory: no thread wakes for it.
- P still sends ``KVLanded`` once it saw the copies land, so a bell that never rings costs
  latency, not the room.

Room ids are random odd 63-bit numbers (the router's), so a zeroed slot never holds one,
and a slot is reused only after ``SLOTS`` later rooms.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from baton.common.devices import (
    cuda_host_register,
    cuda_host_unregister,
    shared_host_fd,
    shared_host_zeros,
)
from baton.common.transfer.base import TransferError

logger = logging.getLogger(__name__)

SLOTS = 4096
_WORD = 8  # int64


class Doorbells:
    """D's side: the slots, in a memfd that P maps through ``/proc/<pid>/fd/<fd>``."""

    def __init__(self, slots: int = SLOTS):
        memory = shared_host_zeros(slots * _WORD)
        fd = shared_host_fd(memory)
        if fd is None:
            raise RuntimeError("doorbells need memfd_create (Linux)")
        self.fd, self.slots = fd, slots
        self._memory = memory  # keeps the mapping
        self._words = memory.numpy().view(np.int64)
        self._next = itertools.count()
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """A slot for a new room, zeroed."""
        with self._lock:
            slot = next(self._next) % self.slots
            self._words[slot] = 0
        return slot

    def rung(self, slot: int, room: int) -> bool:
        """Whether P rang ``slot`` for ``room``: every byte of the room's pages landed."""
        if int(self._words[slot]) != room:
            return False
        # A barrier (a lock's acquire) between seeing the bell and reading what it guards,
        # for CPUs that reorder loads; x86 does not.
        with self._lock:
            return True


class BellMapping:
    """P's side: D's slots mapped into this process; on a GPU also registered with CUDA so
    that a copy stream can write them."""

    def __init__(self, pid: int, fd: int, slots: int, device: torch.device | None):
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            raise TransferError(f"cannot open the peer's doorbells: {exc}") from exc
        try:
            if os.fstat(handle).st_size < slots * _WORD:
                raise TransferError("the peer's doorbells are smaller than announced")
            self._mapping = mmap.mmap(handle, slots * _WORD, mmap.MAP_SHARED)
        finally:
            os.close(handle)
        self.slots = slots
        self._words = torch.frombuffer(self._mapping, dtype=torch.int64, count=slots)
        self._registered = False
        self._source: dict[torch.device, torch.Tensor] = {}  # a word per device to copy from
        self._lock = threading.Lock()
        if device is not None and device.type == "cuda":
            self._register()

    def _register(self) -> None:
        """Pin the slots for the GPU, so that a copy into them is queued, not waited for.
        Unregistered when this goes (closed or not), before its mapping is unmapped: a
        registration left behind would make the next mapping at that address fail to
        register."""
        portable = 1  # cudaHostRegisterPortable: pinned for every device's context
        ptr = self._words.data_ptr()
        error = cuda_host_register(ptr, self.slots * _WORD, portable)
        if error:
            logger.info("kv doorbell: slots not registered with CUDA (%s): rung by the CPU", error)
            return
        self._registered = True
        self._unregister = weakref.finalize(self, cuda_host_unregister, ptr)

    @property
    def launches(self) -> bool:
        return self._registered

    def ring(self, slot: int, room: int) -> None:
        """Ring from the CPU: the caller saw every byte land."""
        self._check(slot)
        with self._lock:  # a release barrier after the writes it announces
            self._words[slot] = room

    def launch_ring(self, slot: int, room: int, stream: torch.cuda.Stream) -> None:
        """Ring from `stream`, behind everything queued on it so far (only where
        ``launches``): the copy engine writes the room id once the copies before it ran."""
        self._check(slot)
        device = stream.device
        with self._lock:
            source = self._source.get(device)
            if source is None:
                source = self._source[device] = torch.zeros((), dtype=torch.int64, device=device)
            with torch.cuda.stream(stream):
                source.fill_(room)
                self._words[slot].copy_(source, non_blocking=True)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise TransferError(f"doorbell slot {slot} outside the peer's {self.slots}")

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self._unregister()
