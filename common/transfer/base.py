"""The KV transfer contract: one poll-state enum, the arguments, and three small classes.

A *room* (a random 63-bit id minted by the router) names one handoff of one request's KV
pages from a prefill worker P (the sender) to a decode worker D (the receiver)::

    D: create_receiver(room, P) ── init(dst pages) ──ZMQ──▶ P: create_sender(room, D)
                                                            send(src pages) … (chunks)
    D: pages written ◀──────────── data plane ───────────── transfer workers
    D: Success, aux  ◀──────────── ZMQ: done(aux) ───────── finish(aux)

Both sides walk the same forward-only state machine (``KVPoll``); ``Failed`` wins any race
among the non-terminal states, and every non-terminal state has a deadline. ``Success`` and
``Failed`` are terminal: nothing moves a room out of them.

Threading: every method on these classes is non-blocking and safe to call from the
scheduler's busy loop; background threads owned by the manager do all network I/O. The one
bounded wait is ``KVReceiver.release()`` of a room whose pages are being written at that
instant (see its docstring).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Role = Literal["prefill", "decode"]


class KVPoll(enum.IntEnum):
    """Per-room state, the same on both sides; values only grow."""

    Bootstrapping = 0
    WaitingForInput = 1
    Transferring = 2
    Success = 3
    Failed = 4

    @property
    def terminal(self) -> bool:
        return self >= KVPoll.Success


class TransferError(Exception):
    """A failure that ends one room (the message becomes its failure reason)."""


class PeerLostError(TransferError):
    """The connection to a peer broke: every room bound to that peer fails."""


@dataclass(frozen=True)
class Deadlines:
    """Seconds a room may spend in each non-terminal state before it fails."""

    bootstrap_s: float = 30.0
    waiting_s: float = 30.0
    transferring_s: float = 60.0

    def seconds(self, state: KVPoll) -> float | None:
        """The limit for ``state``; None for the terminal states."""
        return {
            KVPoll.Bootstrapping: self.bootstrap_s,
            KVPoll.WaitingForInput: self.waiting_s,
            KVPoll.Transferring: self.transferring_s,
        }.get(state)


@dataclass(frozen=True, eq=False)
class KVArgs:
    """What a manager needs to know about its worker.

    ``buffer`` is the worker's whole KV pool: one contiguous tensor laid out page-major, so
    page ``p`` is bytes ``[p * page_bytes, (p + 1) * page_bytes)`` of it.
    """

    buffer: torch.Tensor
    page_bytes: int
    num_pages: int
    host: str = "127.0.0.1"  # the control socket and the tcp listener bind here
    advertise_host: str | None = None  # how peers reach this host, if not ``host``
    control_port: int = 0  # 0: a free port
    token: str = ""  # cluster token: messages and connections without it are dropped
    verify_checksum: bool = False  # debug: crc32 per region, verified after the write
    deadlines: Deadlines = field(default_factory=Deadlines)
    transfer_threads: int = 2  # sender threads (and connections) per destination
    fault_plan: str | None = None  # `fake` backend only; else $BATON_FAKE_TRANSFER

    def __post_init__(self) -> None:
        if self.page_bytes <= 0 or self.num_pages <= 0:
            raise ValueError("page_bytes and num_pages must be positive")
        if not self.buffer.is_contiguous():
            raise ValueError("the KV buffer must be one contiguous tensor")
        nbytes = self.buffer.numel() * self.buffer.element_size()
        if nbytes != self.page_bytes * self.num_pages:
            raise ValueError(
                f"buffer holds {nbytes} bytes, expected num_pages * page_bytes = "
                f"{self.num_pages} * {self.page_bytes}"
            )
        if self.transfer_threads < 1:
            raise ValueError("transfer_threads must be at least 1")
        if len(self.token) > 256:
            raise ValueError("the cluster token must be at most 256 characters")


class KVRoomHandle(ABC):
    """What sender and receiver share: state, failure, abort, release."""

    room: int
    # W3C trace context of this side's traced request, sent to the peer in the control
    # messages (D's init, P's final status), and the peer's once it arrived; None: untraced.
    # Each side's span of the room links to the other's, whichever process emits it.
    trace_context: str | None = None
    peer_trace_context: str | None = None
    # The backend the room's pages went through (P: its connection's, once it wrote any;
    # D: what P's final status said), whatever the worker was configured with (auto).
    backend: str | None = None

    @abstractmethod
    def poll(self) -> KVPoll:
        """The room's state now (a lapsed deadline fails it first). Never blocks."""

    @property
    @abstractmethod
    def failure_reason(self) -> str | None:
        """Why the room failed (e.g. "deadline in WaitingForInput", "peer lost")."""

    @abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Fail the room and tell the peer. No-op once the room is terminal."""

    @abstractmethod
    def release(self) -> None:
        """Forget the room (aborting it first unless terminal). Idempotent."""


class KVReceiver(KVRoomHandle):
    """D's side of one room. D owns the destination pages; it frees them after release()."""

    @abstractmethod
    def init(self, dst_page_ids: Sequence[int], prefix_pages: int = 0) -> None:
        """Ask P for the pages of the request after the first ``prefix_pages`` (which D
        already holds from its own prefix cache): request page ``prefix_pages + i`` goes to
        ``dst_page_ids[i]``. Moves Bootstrapping -> WaitingForInput."""

    @property
    @abstractmethod
    def aux(self) -> bytes | None:
        """The opaque payload P attached to finish(), once the room succeeded."""

    @property
    @abstractmethod
    def regions(self) -> int:
        """Regions written into this room's pages so far."""

    @property
    def reusable(self) -> bool:
        """Whether D may give the room's pages to another request: no byte can land in them
        any more. Always true unless a backend that writes into D's memory directly (ipc)
        was offered; then a failed room's pages wait for P to release the room."""
        return True


class KVSender(KVRoomHandle):
    """P's side of one room. P owns the source pages; it must keep them unchanged until the
    room is terminal, then release() and unlock them."""

    @property
    @abstractmethod
    def num_dst_pages(self) -> int | None:
        """How many pages D asked for (None until bootstrapped)."""

    @property
    @abstractmethod
    def prefix_pages(self) -> int | None:
        """Leading request pages D already has and P skips (None until bootstrapped)."""

    @property
    @abstractmethod
    def regions(self) -> int:
        """Contiguous regions pushed for this room so far (after coalescing)."""

    @abstractmethod
    def send(
        self, src_page_ids: Sequence[int], dst_start: int, ready: torch.cuda.Event | None = None
    ) -> None:
        """Queue ``src_page_ids`` to be written into D's pages
        ``dst_page_ids[dst_start : dst_start + len(src_page_ids)]`` (indices within the
        non-prefix part). ``ready``: the pages hold their final KV once this CUDA event has
        fired (the step that computed them may still run); the transfer waits for it.
        Non-blocking; raises ValueError on pages out of range or sent twice. Ignored once
        the room has failed."""

    @abstractmethod
    def finish(self, aux: bytes) -> None:
        """After the last send(): once every queued page is written, send ``aux`` with the
        final status; both sides then reach Success. Every destination page must have been
        sent (ValueError otherwise)."""


class KVManager(ABC):
    """One per worker: the control socket, the data plane, the transfer threads, the rooms."""

    role: Role

    @property
    @abstractmethod
    def control_address(self) -> str:
        """``host:port`` of the ZMQ KV-control socket (advertised host). Peers name this
        worker by it, so it must be spelled as the cluster registry spells it."""

    @property
    @abstractmethod
    def transfer_address(self) -> str | None:
        """Where senders push pages (decode role); None on a prefill worker."""

    @abstractmethod
    def create_receiver(self, room: int, peer_control_address: str) -> KVReceiver:
        """Decode role: a new receiver, in Bootstrapping, for ``room`` from that P."""

    @abstractmethod
    def create_sender(self, room: int, peer_control_address: str) -> KVSender:
        """Prefill role: a new sender for ``room`` to that D; Bootstrapping until D's init
        arrives (an init that came earlier was kept and applies at once)."""

    @abstractmethod
    def fail_peer(self, control_address: str, reason: str = "peer lost") -> int:
        """Fail every live room bound to that peer (e.g. its heartbeat lapsed); returns how
        many rooms failed."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for metrics: bytes, seconds, regions, pages, rooms ok/failed by reason,
        seconds spent in each state."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every thread and close every socket. Live rooms are left as they are."""
