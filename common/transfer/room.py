"""One side's state machine of one room, and the manager's counters.

``RoomState`` is pure bookkeeping (no I/O): forward-only moves, the first failure reason,
per-state deadlines and the time spent in each state. Its owner (sender or receiver) does
the follow-ups of a move: telling the peer, recording stats.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.messages import ControlMessage
from baton.common.transfer.regions import ByteBuffer

Clock = Callable[[], float]


class RoomState:
    """Forward-only state with a deadline per non-terminal state. Thread-safe."""

    def __init__(self, room: int, peer: str, deadlines: Deadlines, clock: Clock = time.monotonic):
        self.room = room
        self.peer = peer  # the other side's control address
        self._deadlines = deadlines
        self._clock = clock
        self._lock = threading.Lock()
        self._state = KVPoll.Bootstrapping
        self._entered = clock()
        self._confirmed = 0.0  # when the peer last said it still holds the room
        self._seconds: dict[KVPoll, float] = {}
        self.failure_reason: str | None = None

    @property
    def state(self) -> KVPoll:
        return self._state

    def advance(self, to: KVPoll) -> bool:
        """Move forward to ``to`` (never to Failed: use fail). False if not a forward move."""
        assert to != KVPoll.Failed
        with self._lock:
            if self._state.terminal or to <= self._state:
                return False
            self._enter(to)
            return True

    def fail(self, reason: str) -> bool:
        """Fail with ``reason`` unless already terminal; True if this call failed it."""
        with self._lock:
            if self._state.terminal:
                return False
            self.failure_reason = reason
            self._enter(KVPoll.Failed)
            return True

    def confirm(self) -> None:
        """The peer still holds the room: it is queued or busy, not lost. The deadline of
        the current state counts from now (back-pressure is not a fault)."""
        self._confirmed = self._clock()

    def lapsed(self) -> str | None:
        """A failure reason if the current state's deadline has passed, else None."""
        state = self._state
        limit = self._deadlines.seconds(state)
        if limit is not None and self._clock() - max(self._entered, self._confirmed) > limit:
            return f"deadline in {state.name}"
        return None

    def seconds_in_states(self) -> dict[str, float]:
        """Seconds spent in each state left so far."""
        with self._lock:
            return {state.name: seconds for state, seconds in self._seconds.items()}

    def _enter(self, state: KVPoll) -> None:
        now = self._clock()
        self._seconds[self._state] = self._seconds.get(self._state, 0.0) + now - self._entered
        self._state = state
        self._entered = now


def reason_kind(reason: str) -> str:
    """The reason without its detail ("aborted by peer: client gone" -> "aborted by peer"),
    so metrics labels stay few."""
    return reason.split(":", 1)[0]


class TransferStats:
    """Thread-safe counters of one manager, read by ``KVManager.stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._failed: Counter[str] = Counter()
        self._state_seconds: defaultdict[str, float] = defaultdict(float)

    def add(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def add_seconds(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds

    def room_done(self, state: RoomState) -> None:
        """Record a room that reached a terminal state (call once per room)."""
        with self._lock:
            if state.state == KVPoll.Success:
                self._counts["rooms_ok"] += 1
            else:
                self._failed[reason_kind(state.failure_reason or "unknown")] += 1
            for name, seconds in state.seconds_in_states().items():
                self._state_seconds[name] += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out.update({f"{name}_seconds": value for name, value in self._seconds.items()})
            out["rooms_ok"] = self._counts["rooms_ok"]
            out["rooms_failed"] = dict(self._failed)
            out["state_seconds"] = dict(self._state_seconds)
            return out


@dataclass(frozen=True)
class RoomServices:
    """What a sender or receiver needs from its manager (and nothing more)."""

    token: str
    page_bytes: int
    num_pages: int
    checksum: bool  # this side's verify_checksum
    deadlines: Deadlines
    stats: TransferStats
    send_control: Callable[[str, ControlMessage], None]
    forget: Callable[[int], None]  # drop the room from the manager's table
    buffer: ByteBuffer | None = None  # this side's KV buffer (checks of direct writes)
