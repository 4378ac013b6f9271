"""KV transfer: moves a request's KV pages from a prefill worker to a decode worker.

- ``base``: the contract: ``KVPoll``, ``KVArgs``, ``KVManager`` / ``KVSender`` / ``KVReceiver``.
- ``manager``: ``TransferManager``, the one implementation of the contract (rooms, ZMQ
  control plane in ``control``, transfer workers in ``workers``).
- ``sender`` / ``receiver``: the two sides of a room; ``room``: state machine and stats.
- ``backend``: the data-plane interface; ``tcp``, ``ipc``, ``ucx``, ``fake`` and ``auto``
  (one of the others per peer) implement it; ``registry`` builds them by name.
- ``address``: the one codec of struct-carrying addresses (``auto``, ``ipc``).
- ``messages``: everything on the wire (msgspec); ``regions``: page runs -> byte regions.
- ``testing``: buffers, manager pairs and waits for tests and benchmarks.

Importing the package imports no torch (the command line reads the backend registry's
names); the names below load from their modules when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from baton.common.transfer.registry import make_backend

_HOME = {"make_backend": "registry", "TransferManager": "manager"}

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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_HOME.get(name, 'base')}")
    return getattr(module, name)
