"""deploy/netns: a cluster with every process in a network namespace of its own.

`up.sh` puts bootstrap, router, one prefill and one decode worker on a private bridge; the
test talks to the router from the root namespace at the router's bridge address, checks
greedy output against the in-process engine on the same model, checks that the KV cache
really went from P to D across the namespaces' interfaces, and that `down.sh` leaves
nothing behind. Skips where namespaces cannot be made (no root / no CAP_NET_ADMIN).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from baton.common.engine import Engine
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel
from baton.common.sampling import SamplingParams
from baton.common.tokenizer import Tokenizer
from tests.conftest import random_prompts

pytestmark = pytest.mark.timeout(300)

NETNS = Path(__file__).resolve().parents[2] / "deploy" / "netns"
PAGE_SIZE = 4  # > 1, so prompts end in partial pages
MAX_NEW = 16
PROMPT_LENGTHS = [5, 13, 30]


@dataclass(frozen=True)
class NetnsRun:
    run: str
    env: dict[str, str]  # the environment up.sh ran with; down.sh gets the same
    info: dict[str, str]  # cluster.env
    state: Path

    @property
    def router_url(self) -> str:
        return self.info["ROUTER_URL"]

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.info["SUBNET"])

    @property
    def namespaces(self) -> list[str]:
        return self.info["NAMESPACES"].split()

    def metrics_urls(self, role: str) -> list[str]:
        return self.info[f"{role.upper()}_METRICS"].split()


def _netns_unavailable() -> str | None:
    """Why this machine cannot run the emulation, or None if it can."""
    for tool in ("ip", "flock", "setsid"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"baton-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return (
            "cannot create network namespaces here (needs root, or CAP_NET_ADMIN and "
            f"CAP_SYS_ADMIN): `ip netns add` said: {made.stderr.strip()}"
        )
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=10)
    return None


def _read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value.strip('"')
    return out


def _leftovers(run: str, state: Path) -> list[str]:
    """Everything of `run` still on this machine."""
    found = []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [n for n in re.findall(r"^(\S+)", namespaces, re.M) if n.startswith(f"baton-{run}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [m for m in re.findall(r"^\d+: ([^:@]+)", links, re.M) if f"-{run}" in m]
    pids_file = state / run / "pids"
    if pids_file.exists():
        for line in pids_file.read_text().splitlines():
            name, pid = line.split()
            if Path(f"/proc/{pid}").exists():
                found.append(f"process {name} (pid {pid})")
    if (state / run).exists():
        found.append(f"state folder {state / run}")
    return found


def _down(env: dict[str, str], run: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(NETNS / "down.sh"), run], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def netns_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[NetnsRun]:
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    run = secrets.token_hex(3)
    state = tmp_path_factory.mktemp("netns")
    # Nothing of the caller's BATON_* or proxy settings leaks into the cluster.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("BATON_") and "proxy" not in k.lower()
    }
    env.update(
        BATON_NETNS_RUN=run,
        BATON_NETNS_STATE=str(state),
        BATON_NETNS_TIMEOUT="150",
        BATON_NETNS_GRACE="10",
        BATON_CMD=f"{sys.executable} -m baton.services.cli",
        BATON_MODEL=str(tiny_model),
        BATON_PAGE_SIZE=str(PAGE_SIZE),
        BATON_TRANSFER_BACKEND="tcp",
        BATON_CLUSTER_TOKEN=secrets.token_hex(16),
        HF_HUB_OFFLINE="1",
    )
    try:
        up = subprocess.run(
            ["bash", str(NETNS / "up.sh")], env=env, capture_output=True, text=True, timeout=200
        )
        if up.returncode != 0:
            pytest.fail(f"deploy/netns/up.sh exited {up.returncode}:\n{up.stdout}\n{up.stderr}")
        info = _read_env_file(state / run / "cluster.env")
        yield NetnsRun(run, env, info, state)
    finally:
        first, second = _down(env, run), _down(env, run)
        left = _leftovers(run, state)
        assert first.returncode == 0, first.stderr
        assert second.returncode == 0, f"down.sh is not idempotent: {second.stderr}"
        assert not left, f"down.sh left behind: {left}"


@pytest.fixture(scope="module")
def client(netns_run: NetnsRun) -> Iterator[httpx.Client]:
    # trust_env=False: never through a proxy; only our own namespaces' addresses are contacted
    with httpx.Client(base_url=netns_run.router_url, timeout=60, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations of the test prompts by the in-process engine."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(PROMPT_LENGTHS, vocab, seed=7)
    engine = Engine(tiny_model, page_size=PAGE_SIZE)
    outs = engine.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    )
    return {tuple(p): o.output_ids for p, o in zip(prompts, outs, strict=True)}


def _role_stats(url: str) -> dict[str, float]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        text = c.get(f"{url}/metrics").text
    pattern = r'^baton_worker_role_bytes\{detail="",name="([^"]+)"\} (\S+)$'
    return {name: float(value) for name, value in re.findall(pattern, text, re.M)}


def _role_stats_once(url: str, name: str, timeout: float = 5.0) -> dict[str, float]:
    """The worker's role stats once `name` is counted (workers publish stats every 0.25 s)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _role_stats(url)
        if stats.get(name, 0) > 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _rx_bytes(namespace: str) -> int:
    out = subprocess.run(
        ["ip", "-j", "-s", "-n", namespace, "link", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def test_generate_through_router_matches_engine(
    client: httpx.Client, expected: dict[tuple[int, ...], list[int]]
) -> None:
    for prompt, want in expected.items():
        body = {
            "input_ids": list(prompt),
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        }
        resp = client.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == want, f"prompt of {len(prompt)} tokens"


def test_completion_text_matches_engine(
    client: httpx.Client,
    expected: dict[tuple[int, ...], list[int]],
    tiny_model: Path,
) -> None:
    tokenizer = Tokenizer.load(tiny_model)
    model = client.get("/v1/models").json()["data"][0]["id"]
    prompt, want = next(iter(expected.items()))
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == tokenizer.decode(want)


def test_kv_cache_crossed_the_bridge(
    netns_run: NetnsRun, client: httpx.Client, expected: dict[tuple[int, ...], list[int]]
) -> None:
    # at least one request went through P and D (whatever ran before this test)
    prompt = list(next(iter(expected)))
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    assert client.post("/generate", json=body).status_code == 200

    (prefill,), (decode,) = netns_run.metrics_urls("prefill"), netns_run.metrics_urls("decode")
    sent = _role_stats_once(prefill, "kv_bytes_sent")
    received = _role_stats_once(decode, "kv_bytes_received")
    assert sent.get("kv_bytes_sent", 0) > 0, sent
    assert received.get("kv_bytes_received", 0) > 0, received
    # P and D share no loopback: those bytes came in on the decode namespace's own eth0
    decode_ns = next(n for n in netns_run.namespaces if n.endswith("-d0"))
    assert _rx_bytes(decode_ns) >= received["kv_bytes_received"]


def test_workers_registered_bridge_addresses(netns_run: NetnsRun) -> None:
    async def list_workers() -> list[pb.WorkerInfo]:
        channel = make_channel(netns_run.info["BOOTSTRAP"], netns_run.env["BATON_CLUSTER_TOKEN"])
        try:
            reply = await pb_grpc.BootstrapStub(channel).List(pb.ListRequest(), timeout=10)
            return list(reply.workers)
        finally:
            await channel.close()

    workers = asyncio.run(list_workers())
    assert sorted(w.role for w in workers) == sorted([pb.Role.PREFILL, pb.Role.DECODE])
    for w in workers:
        addresses = [w.grpc_address, w.http_address, w.kv_control_address]
        if w.role == pb.Role.DECODE:
            addresses.append(w.transfer_address)  # only the receiving side listens
        for address in addresses:
            host = ipaddress.IPv4Address(address.rpartition(":")[0])
            assert host in netns_run.subnet and host != netns_run.subnet[1], (w.worker_id, address)


def test_up_refuses_a_run_that_exists(netns_run: NetnsRun, client: httpx.Client) -> None:
    again = subprocess.run(
        ["bash", str(NETNS / "up.sh")],
        env=netns_run.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode != 0
    assert "already exists" in again.stderr
    assert client.get("/health").status_code == 200  # the running cluster was left alone
