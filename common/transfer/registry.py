"""The transfer backends by name: the choices of ``--transfer-backend``.

Each factory imports its backend only when called, so reading the names (the command line
does) imports no torch and no backend. The registry sits above the backends: they import
the interface (``backend``), never this module; `auto`, which builds other backends, is
handed ``make_backend`` by its factory here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.common.transfer.backend import TransferBackend


def _auto() -> TransferBackend:
    from baton.common.transfer.auto import AutoBackend

    return AutoBackend(make_backend)


def _ipc() -> TransferBackend:
    from baton.common.transfer.ipc import IpcBackend

    return IpcBackend()


def _tcp() -> TransferBackend:
    from baton.common.transfer.tcp import TcpBackend

    return TcpBackend()


def _ucx() -> TransferBackend:
    from baton.common.transfer.ucx import UcxBackend

    return UcxBackend()


def _fake() -> TransferBackend:
    from baton.common.transfer.fake import FakeBackend

    return FakeBackend()


_FACTORIES: dict[str, Callable[[], TransferBackend]] = {
    "auto": _auto,
    "ipc": _ipc,
    "tcp": _tcp,
    "ucx": _ucx,
    "fake": _fake,
}


def backend_names() -> Iterator[str]:
    return iter(sorted(_FACTORIES))


def register_backend(name: str, factory: Callable[[], TransferBackend]) -> None:
    _FACTORIES[name] = factory


def make_backend(name: str) -> TransferBackend:
    """A new backend by name; an unusable one (ucx without ucxx) raises RuntimeError."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown transfer backend {name!r}; known: {sorted(_FACTORIES)}"
        ) from None
    return factory()
