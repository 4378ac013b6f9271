"""`baton up --registry etcd://...`: a real cluster of processes whose membership lives in a
real etcd. One cluster (1 prefill, 1 decode, lease 2 s) serves the module; the tests run in
order and the last one kills the decode worker."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import Cluster, cluster
from tests.integration.etcd_server import EtcdServer
from tests.integration.test_pd_cluster import MAX_NEW, expected, generate, prompts

pytestmark = pytest.mark.timeout(300)

LEASE_TTL = 2.0  # what tests/integration/cluster.py gives `baton up`
PREFILL, DECODE = 2, 3
AUTH = {"authorization": "Bearer k"}


@pytest.fixture(scope="module")
def pd(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    args = ["--prefill", "1", "--decode", "1", "--registry", etcd_server.url(), "--api-key", "k"]
    with cluster(tmp_path_factory.mktemp("etcd-pd"), *args) as c:
        yield c


def health(c: Cluster) -> dict[str, Any]:
    import json

    try:
        with urllib.request.urlopen(c.url + "/health", timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return dict(json.loads(e.read()))


def membership_log(c: Cluster) -> str:
    """What the processes said about membership (for failure messages)."""
    words = ("joined", "left", "reachable", "registering again", "watch lost", "refused")
    lines = [
        f"{log.stem}: {line}"
        for log in sorted(c.log_dir.glob("*.log"))
        for line in log.read_text().splitlines()
        if any(w in line for w in words)
    ]
    return "\n".join(sorted(lines, key=lambda line: line.split(": ", 1)[1])[-40:])


def test_pd_greedy_output_over_etcd_equals_the_engine(pd: Cluster) -> None:
    assert sorted(w.role for w in pd.workers()) == [PREFILL, DECODE]
    assert health(pd)["registry"] == {"address": pd.registry, "state": "connected"}
    ps = prompts()
    with cf.ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(lambda p: generate(pd, p), ps))
    for p, body in zip(ps, bodies, strict=True):
        assert body["output_ids"] == expected(p), f"prompt of {len(p)}"
    pd.wait_idle()


def test_a_worker_whose_kv_layout_does_not_match_is_refused(pd: Cluster, tmp_path: Path) -> None:
    log = tmp_path / "odd-decode.log"
    with open(log, "wb") as out:
        odd = subprocess.Popen(
            [sys.executable, "-m", "baton.services.cli", "decode", "--registry", pd.registry,
             "--model", pd.model, "--page-size", "4", "--worker-id", "odd-decode",
             "--lease-ttl", str(LEASE_TTL), "--heartbeat-interval", "0.5"],
            env={**os.environ, "BATON_CLUSTER_TOKEN": pd.token},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "registry refused worker odd-decode" not in log.read_text():
            assert odd.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.3)
        assert "page_size 4 != 1" in log.read_text()
        assert "odd-decode" not in [w.worker_id for w in pd.workers()]
        assert health(pd)["workers"]["decode"] == 1
        assert generate(pd, prompts()[0])["output_ids"] == expected(prompts()[0])
    finally:
        odd.send_signal(signal.SIGTERM)
        try:
            odd.wait(timeout=30)
        except subprocess.TimeoutExpired:
            odd.kill()
            odd.wait()


def test_an_etcd_restart_under_steady_load_fails_no_request(
    pd: Cluster, etcd_server: EtcdServer
) -> None:
    stop = threading.Event()
    results: list[int] = []
    body = {
        "input_ids": prompts()[1],
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    }

    def client() -> None:
        while not stop.is_set():
            status, answer = pd.post("/generate", body, headers=AUTH)
            results.append(status)
            assert status != 200 or answer["output_ids"] == expected(prompts()[1])

    with cf.ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(client) for _ in range(3)]
        try:
            time.sleep(2)
            before = len(results)
            etcd_server.stop()
            seen_unreachable = False
            outage_end = time.monotonic() + 3 * LEASE_TTL  # longer than any lease
            while time.monotonic() < outage_end:
                state = health(pd)
                assert state["status"] == "ok", state  # the last known workers keep serving
                seen_unreachable |= state["registry"]["state"] == "unreachable"
                time.sleep(0.2)
            etcd_server.start()
            deadline = time.monotonic() + 20
            while health(pd)["registry"]["state"] != "connected":
                assert time.monotonic() < deadline, "the router's watch never resumed"
                time.sleep(0.2)
            time.sleep(2)
        finally:
            if etcd_server.proc is None:
                etcd_server.start()
            stop.set()
        for f in clients:
            f.result()
    assert seen_unreachable, "/health never said the registry was unreachable"
    assert len(results) - before >= 6, "the load kept flowing during the outage"
    failed = [s for s in results if s != 200]
    assert not failed, f"failed requests: {failed}\n{membership_log(pd)}"
    assert sorted(w.role for w in pd.workers()) == [PREFILL, DECODE]  # leases survived


def test_a_killed_worker_leaves_etcd_within_its_lease_and_routing_after(pd: Cluster) -> None:
    """Last in this module: it kills the decode worker."""
    victim = next(w for w in pd.workers() if w.role == DECODE)
    port = victim.grpc_address.rsplit(":", 1)[1]
    pid = None
    for log in pd.log_dir.glob("decode-*.log"):
        for line in log.read_text().splitlines():
            if f"grpc=127.0.0.1:{port} " in line and "BATON_WORKER_PID=" in line:
                pid = int(line.split("BATON_WORKER_PID=")[1].split()[0])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while victim.worker_id in [w.worker_id for w in pd.workers()]:
        # etcd expires leases on a 0.5 s tick; the last renewal was up to a heartbeat earlier.
        assert time.monotonic() - killed < LEASE_TTL + 1, "the key outlived its lease"
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while health(pd)["workers"]["decode"] != 0:
        assert time.monotonic() < deadline, "the router still routes to the dead worker"
        time.sleep(0.1)
    # Nothing is sent to the dead worker: no pair is left, so the answer is an immediate 503.
    asked = time.monotonic()
    status, body = pd.post("/generate", {"input_ids": prompts()[0]}, headers=AUTH)
    assert (status, body["error"]["code"]) == (503, "no_workers")
    assert time.monotonic() - asked < 5
