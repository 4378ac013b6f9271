"""KV transfer: moves a request's KV pages from a prefill worker to a decode worker.

- ``base``: the contract: ``KVPoll``, ``KVArgs``, ``KVManager`` / ``KVSender`` / ``KVReceiver``.
- ``manager``: ``TransferManager``, the one implementation of the contract (rooms, ZMQ
  control plane in ``control``, transfer workers in ``workers``).
- ``sender`` / ``receiver``: the two sides of a room; ``room``: state machine and stats.
- ``backend``: the data-plane interface and registry; ``tcp``, ``ucx``, ``fake`` implement it.
- ``messages``: everything on the wire (msgspec); ``regions``: page runs -> byte regions.
- ``testing``: buffers, manager pairs and waits for tests and benchmarks.
"""

from baton.common.transfer.backend import make_backend
from baton.common.transfer.base import (
    Deadlines,
    KVArgs,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    PeerLostError,
    TransferError,
)
from baton.common.transfer.manager import TransferManager

__all__ = [
    "Deadlines",
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "PeerLostError",
    "TransferError",
    "TransferManager",
    "make_backend",
]
