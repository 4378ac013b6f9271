"""The `auto` backend (the default): picks the data plane per peer pair.

A decode worker starts every backend it can offer and advertises them in one transfer
address, ``"auto:" + base64url(msgpack(Offer))`` (a few hundred characters): ``tcp`` always; ``ipc`` when its pool can be
mapped by another process (a CUDA pool, or the memfd host pool); ``ucx`` for a CUDA pool
when ucxx is installed (GPU memory across hosts, RDMA where present). A prefill worker
compares the offer with what it can do itself (`choose`) and connects through the best
backend both share, falling back to the next one if that fails:

    ipc   same host (boot, IPC namespace; PID namespace for a host pool) and, for a CUDA
          pool, D's GPU visible to P: one device copy per region, no host memory
    ucx   both have ucxx: UCX picks NVLink, RDMA or TCP for GPU memory
    tcp   always: plain sockets (a CUDA pool is staged through pinned host memory)

The choice is logged once per peer and counted in the manager's statistics
(``connections_<backend>``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

import baton.common.transfer.ipc as ipc
from baton.common.transfer.address import AddressCodec
from baton.common.transfer.backend import DataConnection, RegionSink, TransferBackend
from baton.common.transfer.base import KVArgs, PeerLostError, TransferError
from baton.common.transfer.ipc import IpcExport, exportable, host_identity, same_host
from baton.common.transfer.messages import DataHello

logger = logging.getLogger(__name__)

PREFERENCE = ("ipc", "ucx", "tcp")


class Offer(msgspec.Struct, frozen=True, array_like=True):
    """What a decode worker offers: its host, its pool's GPU, and a transfer address per
    backend it started (ipc's export is kept as is: its address would encode it twice)."""

    host: str  # ipc.host_identity()
    gpu: str  # UUID of the GPU holding the pool ("" for a host pool)
    addresses: dict[str, str]  # backend -> its transfer address (ipc: "")
    ipc: IpcExport | None = None


_ADDRESS = AddressCodec("auto", Offer)
encode_address = _ADDRESS.encode
decode_address = _ADDRESS.decode


@dataclass(frozen=True)
class Capabilities:
    """What a prefill worker can do itself."""

    host: str
    gpus: frozenset[str] = field(default_factory=frozenset)  # UUIDs of the GPUs it sees
    backends: frozenset[str] = frozenset({"ipc", "tcp"})


def choose(local: Capabilities, offer: Offer) -> list[str]:
    """The backends P may use for D's offer, best first."""
    out = []
    for name in PREFERENCE:
        if name not in offer.addresses or name not in local.backends:
            continue
        if name == "ipc":
            kind = "cuda" if offer.gpu else "memfd"
            if offer.ipc is None:
                continue
            if not same_host(offer.host, local.host, kind):
                continue
            if offer.gpu and offer.gpu not in local.gpus:
                continue
        out.append(name)
    return out


@functools.cache  # (the process's own: they do not change)
def local_capabilities() -> Capabilities:
    gpus: frozenset[str] = frozenset()
    if torch.cuda.is_available():
        props = (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
        gpus = frozenset(str(p.uuid) for p in props)
    backends = {"ipc", "tcp"}
    if _ucx_available():
        backends.add("ucx")
    return Capabilities(host_identity(), gpus, frozenset(backends))


def _ucx_available() -> bool:
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except Exception:
        return False
    return True


class AutoBackend(TransferBackend):
    name = "auto"

    def __init__(self, make: Callable[[str], TransferBackend]) -> None:
        self._make = make  # the registry's make_backend: a sub-backend by name
        self._lock = threading.Lock()
        self._args: KVArgs | None = None
        self._subs: dict[str, TransferBackend] = {}
        self._local: Capabilities | None = None
        self._chosen: dict[str, str] = {}  # D's address -> the backend P uses with it
        self._connections: dict[str, int] = {}
        self.accepts_direct = False

    def start(self, args: KVArgs, sink: RegionSink | None) -> str | None:
        self._args = args
        # Now, not at the first connect: probing CUDA and ucx took 417 ms on a CPU worker,
        # which a prefill worker's first transfer or a migration's first hand-off waited for.
        self._local = local_capabilities()
        if sink is None:
            return None
        names = ["tcp"]
        if exportable(args.buffer):
            names.insert(0, "ipc")
        if args.buffer.is_cuda and _ucx_available():
            names.insert(-1, "ucx")
        addresses: dict[str, str] = {}
        export = None
        for name in names:
            try:
                address = self._start_sub(name, sink)
            except Exception as exc:  # an optional backend that cannot start is left out
                if name == "tcp":
                    raise
                logger.warning("kv auto: %s unavailable on this worker: %s", name, exc)
                continue
            assert address is not None
            if name == "ipc":
                export, address = ipc.decode_address(address), ""
            addresses[name] = address
        gpu = (
            str(torch.cuda.get_device_properties(args.buffer.device).uuid)
            if args.buffer.is_cuda
            else ""
        )
        self.accepts_direct = any(self._subs[n].accepts_direct for n in addresses)
        if "ipc" in addresses:
            self.doorbells = self._subs["ipc"].doorbells
        logger.info("kv auto: offering %s", ", ".join(addresses))
        return encode_address(Offer(host_identity(), gpu, addresses, export))

    def _start_sub(self, name: str, sink: RegionSink | None) -> str | None:
        assert self._args is not None
        backend = self._make(name)
        address = backend.start(self._args, sink)
        self._subs[name] = backend
        return address

    def _sub(self, name: str) -> TransferBackend:
        with self._lock:
            if name not in self._subs:
                self._start_sub(name, None)
            return self._subs[name]

    def connect(self, address: str, hello: DataHello) -> DataConnection:
        offer = decode_address(address)
        if self._local is None:
            self._local = local_capabilities()
        candidates = choose(self._local, offer)
        if not candidates:
            raise TransferError(
                f"no transfer backend in common with the peer ({list(offer.addresses)})"
            )
        errors: list[str] = []
        lost = True
        for name in candidates:
            address_of = offer.addresses[name]
            if name == "ipc" and offer.ipc is not None:
                address_of = ipc.encode_address(offer.ipc)
            try:
                conn = self._sub(name).connect(address_of, hello)
            except Exception as exc:
                errors.append(f"{name}: {exc}")
                lost = lost and isinstance(exc, PeerLostError)
                logger.warning(
                    "kv auto: %s to %s failed (%s); trying the next", name, hello.peer, exc
                )
                continue
            with self._lock:
                self._connections[name] = self._connections.get(name, 0) + 1
                first = self._chosen.get(address) != name
                self._chosen[address] = name
            if first:
                logger.info(
                    "kv auto: using %s for this decode worker (offered %s)",
                    name,
                    list(offer.addresses),
                )
            return conn
        error = "every transfer backend failed: " + "; ".join(errors)
        raise PeerLostError(error) if lost else TransferError(error)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {f"connections_{name}": n for name, n in self._connections.items()}

    def shutdown(self) -> None:
        for backend in self._subs.values():
            backend.shutdown()
        self._subs.clear()
