"""`auto` picks the data plane per peer pair from what both sides can do."""

from __future__ import annotations

import pytest

from baton.common.transfer.auto import Capabilities, Offer, choose
from baton.common.transfer.ipc import same_host

HOST = "boot-1/ipc:[1]/pid:[1]"
ADDRS = {"ipc": "ipc:00", "ucx": "ucx:00", "tcp": "10.0.0.2:7000"}


def offer(
    host: str = HOST, gpu: str = "GPU-a", names: tuple[str, ...] = ("ipc", "ucx", "tcp")
) -> Offer:
    return Offer(host, gpu, {n: ADDRS[n] for n in names})


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
