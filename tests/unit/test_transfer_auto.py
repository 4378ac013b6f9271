"""`auto` picks the data plane per peer pair from what both sides can do."""

from __future__ import annotations

import pytest

from baton.common.transfer import auto
from baton.common.transfer.auto import Capabilities, Offer, choose
from baton.common.transfer.base import KVArgs, TransferError
from baton.common.transfer.ipc import IpcExport, same_host
from baton.common.transfer.messages import DataHello
from baton.common.transfer.registry import make_backend
from baton.common.transfer.testing import kv_buffer

HOST = "boot-1/ipc:[1]/pid:[1]"
ADDRS = {"ipc": "", "ucx": "ucx:00", "tcp": "10.0.0.2:7000"}


def offer(
    host: str = HOST, gpu: str = "GPU-a", names: tuple[str, ...] = ("ipc", "ucx", "tcp")
) -> Offer:
    export = IpcExport(host, "cuda" if gpu else "memfd", 1024, gpu) if "ipc" in names else None
    return Offer(host, gpu, {n: ADDRS[n] for n in names}, export)


@pytest.mark.parametrize(
    ("local", "remote", "expected"),
    [
        # same host, D's GPU visible to P: a device copy
        (
            Capabilities(HOST, frozenset({"GPU-a", "GPU-b"}), frozenset({"ipc", "ucx", "tcp"})),
            offer(),
            ["ipc", "ucx", "tcp"],
        ),
        # same host but D's GPU hidden from P (CUDA_VISIBLE_DEVICES): no CUDA IPC
        (
            Capabilities(HOST, frozenset({"GPU-b"}), frozenset({"ipc", "ucx", "tcp"})),
            offer(),
            ["ucx", "tcp"],
        ),
        # another host: ucx if both have it, else tcp
        (
            Capabilities(
                "boot-2/ipc:[1]/pid:[1]", frozenset({"GPU-a"}), frozenset({"ipc", "ucx", "tcp"})
            ),
            offer(),
            ["ucx", "tcp"],
        ),
        (
            Capabilities("boot-2/ipc:[1]/pid:[1]", frozenset(), frozenset({"ipc", "tcp"})),
            offer(),
            ["tcp"],
        ),
        # a host pool (no GPU) in another PID namespace: /proc/<pid>/fd is out of reach
        (Capabilities("boot-1/ipc:[1]/pid:[2]"), offer(gpu="", names=("ipc", "tcp")), ["tcp"]),
        (Capabilities(HOST), offer(gpu="", names=("ipc", "tcp")), ["ipc", "tcp"]),
        # D offered only tcp (e.g. --transfer-backend tcp on D)
        (Capabilities(HOST, frozenset({"GPU-a"})), offer(names=("tcp",)), ["tcp"]),
    ],
)
def test_choice(local: Capabilities, remote: Offer, expected: list[str]) -> None:
    assert choose(local, remote) == expected


def test_same_host_needs_the_same_boot_and_namespaces() -> None:
    assert same_host(HOST, HOST, "cuda") and same_host(HOST, HOST, "memfd")
    assert same_host(HOST, "boot-1/ipc:[1]/pid:[9]", "cuda")  # CUDA IPC: PIDs do not matter
    assert not same_host(HOST, "boot-1/ipc:[1]/pid:[9]", "memfd")
    assert not same_host(HOST, "boot-1/ipc:[2]/pid:[1]", "cuda")
    assert not same_host(HOST, "boot-2/ipc:[1]/pid:[1]", "cuda")
    assert not same_host("//", "//", "cuda")  # unknown identities never match


def test_a_gpu_offer_fits_the_worker_registration() -> None:
    """A decode worker registers its `auto` offer; with a CUDA IPC export in it (64-byte
    handles) it must pass the registry's record validation and round-trip intact."""
    from baton.common.rpc import baton_pb2 as pb
    from baton.common.transfer.auto import decode_address, encode_address
    from baton.services.registry.records import to_record

    export = IpcExport(
        "8f1c2a9e-1b2c-4d5e-8f90-123456789abc/ipc:[4026531839]/pid:[4026531836]",
        "cuda", 64 << 30, "GPU-3f1e2d4c-5b6a-7988-1a2b-3c4d5e6f7a8b", bytes(range(64)),
        64 << 30, 0, b"/torch_123456_1234567890_0", 0, bytes(range(64)), True, pid=123456,
    )  # fmt: skip
    offer = Offer(
        export.host,
        export.gpu,
        {"ipc": "", "ucx": "ucx:" + "ab" * 200, "tcp": "10.1.2.3:45678"},
        export,
    )
    address = encode_address(offer)
    info = pb.WorkerInfo(
        worker_id="decode-1", role=pb.DECODE, grpc_address="10.1.2.3:9000", transfer_address=address
    )
    assert to_record(info).transfer_address == address
    assert decode_address(address) == offer


def test_an_address_decodes_only_as_its_own_backend() -> None:
    """`auto` and `ipc` share one codec: a peer's address of the wrong kind, or a garbled
    one, is a TransferError (the connection attempt fails), never a crash."""
    from baton.common.transfer import auto, ipc
    from baton.common.transfer.base import TransferError

    export = IpcExport(HOST, "memfd", 4096, pid=7, fd=3)
    address = ipc.encode_address(export)
    assert address.startswith("ipc:") and ipc.decode_address(address) == export
    with pytest.raises(TransferError, match="not an auto transfer address"):
        auto.decode_address(address)
    with pytest.raises(TransferError, match="malformed ipc transfer address"):
        ipc.decode_address("ipc:!!!")
    with pytest.raises(TransferError, match="malformed auto transfer address"):
        auto.decode_address("auto:" + address[len("ipc:") :])  # an export is not an offer


def test_a_sender_learns_what_it_can_do_when_it_starts_not_at_its_first_connect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe (CUDA, ucx) took 417 ms on a CPU worker: inside a prefill worker's first
    transfer, or a live migration's first hand-off, when it ran at the first connect."""
    probes = []

    def probe() -> Capabilities:
        probes.append(1)
        return Capabilities(HOST, frozenset(), frozenset({"ipc", "tcp"}))

    monkeypatch.setattr(auto, "local_capabilities", probe)
    backend = auto.AutoBackend(make_backend)
    buffer, page_bytes = kv_buffer(1, 1, seed=None)
    backend.start(KVArgs(buffer, page_bytes, 1), None)
    assert probes == [1]
    ucx_only = auto.encode_address(offer(names=("ucx",)))
    with pytest.raises(TransferError, match="no transfer backend in common"):
        backend.connect(ucx_only, DataHello(token="", peer="p:1"))
    assert probes == [1]
    backend.shutdown()
