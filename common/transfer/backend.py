"""Data-plane backends: the interface each one implements (`registry` builds them by name).

A backend moves region payloads from a sender's buffer into a receiver's buffer. It knows
nothing of rooms' states: on the receiving side it asks a ``RegionSink`` (the manager) for
permission before writing each region and reports when the write ended; on the sending side
it pushes what the transfer workers give it.

Receiving-side rules every backend keeps:
- the first frame of a connection is a ``DataHello``; a wrong token closes the connection;
- a region is written only through a ``WriteGrant`` from ``sink.open`` (None: read the
  payload into scratch and drop it; ``ProtocolViolation``: close the connection);
- a write into host memory happens only inside ``grant.hold()`` while it yields True, and a
  write posted to a transport (ucx) only between ``grant.pin()`` and ``grant.unpin()``;
- garbage, oversized or unauthenticated frames are logged and dropped; serving goes on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from baton.common.transfer.base import KVArgs
    from baton.common.transfer.doorbell import Doorbells
    from baton.common.transfer.messages import DataHello, RegionFrame
    from baton.common.transfer.regions import ByteBuffer


class ProtocolViolation(Exception):
    """A peer broke the data-plane rules: the backend drops its connection."""


class WriteGrant(Protocol):
    """Permission to write one region of one room."""

    offset: int  # destination byte offset
    length: int

    def hold(self) -> AbstractContextManager[bool]:
        """While held, the room cannot be released; yields False once it stopped accepting
        (then read the bytes into scratch instead)."""

    def pin(self) -> bool:
        """Before posting a write the transport completes later: False if not accepting."""

    def unpin(self) -> None: ...


class RegionSink(Protocol):
    """The receiving manager, as the backend sees it. Called from backend threads."""

    def hello(self, frame: DataHello) -> bool:
        """True if the connection may go on (right token)."""

    def open(self, frame: RegionFrame, peer: str) -> WriteGrant | None:
        """Validate a region header; raises ProtocolViolation."""

    def close(self, grant: WriteGrant, ok: bool) -> None:
        """The write ended (ok: every byte landed)."""

    def peer_lost(self, peer: str) -> None:
        """A connection from that sender broke."""

    def dropped(self, what: str) -> None:
        """Count (and log) a dropped frame or connection."""


@dataclass(frozen=True, slots=True)
class Outbound:
    """One region to push: its header and where its bytes start in the source buffer."""

    frame: RegionFrame
    src_offset: int


class DataConnection(ABC):
    """A sender's connection to one receiver, used by one transfer-worker thread."""

    backend: ClassVar[str]  # the name of the backend it belongs to (tcp, ipc, ucx, ...)
    direct: ClassVar[bool] = False  # writes land in the receiver's memory without its checks
    # Whether `launch` works, from any thread (device copies into a mapped GPU pool).
    launches: bool = False
    # Whether `ring` works, from any thread: the receiver's doorbells are mapped (ipc).
    rings: bool = False

    @abstractmethod
    def push(self, source: ByteBuffer, items: Sequence[Outbound]) -> None:
        """Write every region; blocks the calling worker thread. Raises PeerLostError."""

    def launch(
        self, source: ByteBuffer, items: Sequence[Outbound], after: torch.cuda.Event | None
    ) -> torch.cuda.Event:
        """Queue the writes on the GPU behind `after` without waiting; the returned event
        fires once every byte landed. Only where `launches`; raises TransferError."""
        raise NotImplementedError

    def ring(self, slot: int, room: int) -> None:
        """Tell the receiver through its doorbell `slot` that every byte of `room` landed
        (the caller saw them land). Only where `rings`."""
        raise NotImplementedError

    def launch_ring(self, source: ByteBuffer, slot: int, room: int) -> bool:
        """Queue the ring on the GPU behind every write launched so far; False where it
        cannot (then ring once the writes landed)."""
        return False

    @abstractmethod
    def close(self) -> None: ...


class TransferBackend(ABC):
    """One per manager. ``start`` once, then ``connect`` from any transfer worker."""

    name: ClassVar[str]
    # Whether a sender may write into this receiver's memory without passing its region
    # checks (ipc): then pages of a failed room are reused only after the sender released it.
    # (Per backend class; `auto` learns it per instance from the backends it starts.)
    accepts_direct: bool = False
    # Receiving side: where senders ring when a room's direct writes landed (see doorbell).
    doorbells: Doorbells | None = None

    @abstractmethod
    def start(self, args: KVArgs, sink: RegionSink | None) -> str | None:
        """Prepare; with a sink (decode role) also listen. Returns the transfer address."""

    @abstractmethod
    def connect(self, address: str, hello: DataHello) -> DataConnection:
        """A new connection to a receiver, hello already sent. Raises PeerLostError."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters of the backend itself, merged into the manager's statistics."""
        return {}

    # Fault-injection points; only the `fake` backend does anything here.
    def before_push(self, room: int) -> None:
        """Called before each batch of a room's regions and before its final status; may
        sleep, or raise TransferError to fail the room."""
        return None

    def deliver_done(self, room: int) -> bool:
        """False: silently never send the room's final status."""
        return True
