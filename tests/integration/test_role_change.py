"""A worker's role changed in place under a steady request stream (issue 41 item 2).

A 1P2D cluster serves three clients sending greedy completions without pause while one
decode worker becomes a prefill worker and back: no request fails, every answer is the
unflipped run's, `/health` counts the roles right before, during (the changing worker
shown apart) and after, and nothing stays held on any worker.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from baton.common.rpc import baton_pb2 as pb
from tests.integration.cluster import Cluster, cluster
from tests.integration.etcd_server import EtcdServer

ADMIN = "admin-" + "role-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}
PROMPT = "The role of a worker"


def _health(c: Cluster) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(c.url + "/health", timeout=5) as r:
            return {"code": r.status, **json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"code": e.code, **json.loads(e.read())}


def _complete(c: Cluster, max_tokens: int = 64) -> tuple[int, str]:
    # never cut short by EOS: a stream lasts long enough on a busy CI machine that the
    # decode worker found busy still runs it when its flip migrates what it runs
    body = {"model": c.model_name, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, out = c.post("/v1/completions", body, timeout=60)
    return status, out["choices"][0]["text"] if status == 200 else json.dumps(out)


class Stream:
    """Clients sending requests back to back until stopped; every answer kept."""

    def __init__(self, c: Cluster, clients: int, max_tokens: int = 64) -> None:
        self.c, self.max_tokens = c, max_tokens
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.answers.append(_complete(self.c, self.max_tokens))

    def __enter__(self) -> Stream:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


class HealthWatch:
    """/health read every 20 ms on a thread while a role changes."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(_health(self.c))
            time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _busy_decode_worker(c: Cluster) -> str:
    """A decode worker running requests now (read from GET /admin/workers)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        request = urllib.request.Request(c.url + "/admin/workers", headers=AUTH)
        with urllib.request.urlopen(request, timeout=10) as r:
            rows = json.loads(r.read())["workers"]
        busy = [w for w in rows if w["role"] == "decode" and w["load"]["in_flight"] > 0]
        if busy:
            return str(max(busy, key=lambda w: w["load"]["in_flight"])["worker_id"])
        time.sleep(0.01)
    raise AssertionError("no decode worker ran a request")


def _flip(c: Cluster, worker_id: str, role: str) -> tuple[int, dict[str, Any]]:
    return c.post(f"/admin/workers/{worker_id}/role", {"role": role}, 90, AUTH)


def _check_flip(c: Cluster, worker_id: str, frm: str, role: str, before: dict[str, int]) -> None:
    after = {**before, role: before[role] + 1}
    after[frm] -= 1
    with HealthWatch(c) as watch:
        status, body = _flip(c, worker_id, role)
    assert status == 200, body
    assert body["role"] == role and body["previous_role"] == frm, body
    total = sum(before.values())
    during = [h for h in watch.seen if worker_id in h.get("changing", {})]
    if body["seconds"] > 0.2:  # (an idle prefill worker changes faster than /health is read)
        assert during, "no /health read saw the change under way"
    for h in watch.seen:
        assert h["code"] == 200 and h["status"] == "ok", json.dumps(h)
        counted = sum(h["workers"].values()) + len(h.get("changing", {}))
        assert counted == total, h  # the changing worker is shown apart, never lost
    for h in during:
        assert worker_id not in h["worker_ids"], h
        assert h["changing"][worker_id] == {"state": h["changing"][worker_id]["state"],
                                            "from": frm, "to": role}, h  # fmt: skip
        assert h["changing"][worker_id]["state"] in ("draining", "switching"), h
    health = _health(c)
    assert health["workers"] == after and health["status"] == "ok", health
    assert health["expected"] == after, health  # the shape follows the change


def test_flip_under_a_steady_stream_fails_no_request(tmp_path: Path) -> None:
    with cluster(
        tmp_path, "--prefill", "1", "--decode", "2", env={"BATON_ADMIN_API_KEY": ADMIN}
    ) as c:
        reference = _complete(c, 128)  # as the stream's below
        assert reference[0] == 200, reference
        health = _health(c)
        assert health["workers"] == {"both": 0, "prefill": 1, "decode": 2}, health
        decode = sorted(w for w in health["worker_ids"] if w.startswith("decode"))[0]
        prefill = next(w for w in health["worker_ids"] if w.startswith("prefill"))

        # Refusals leave everything as it was.
        assert _flip(c, "no-such-worker", "prefill")[0] == 404
        status, body = _flip(c, decode, "sideways")
        assert status == 400 and body["error"]["param"] == "role", body
        status, body = c.post(f"/admin/workers/{decode}/role", {"role": "prefill"}, 10)
        assert status == 401, body
        status, body = c.post(
            f"/admin/workers/{decode}/role", {"role": "prefill", "when": "now"}, 10, AUTH
        )
        assert status == 400, body  # a field the router does not honor
        status, body = _flip(c, prefill, "decode")  # the last prefill worker
        assert status == 409 and "could not serve" in body["error"]["message"], body

        # four streams of 128 tokens: both decode workers run some at every moment (with
        # three of 64, CI twice flipped a worker whose last stream had just ended: nothing
        # to migrate)
        with Stream(c, clients=4, max_tokens=128) as stream:
            decode = _busy_decode_worker(c)  # its requests migrate away
            _check_flip(c, decode, "decode", "prefill", {"both": 0, "prefill": 1, "decode": 2})
            time.sleep(1.0)  # the stream now runs through two prefill workers
            other = next(
                w for w in _health(c)["worker_ids"] if w.startswith("decode") and w != decode
            )
            status, body = _flip(c, other, "prefill")  # the last decode worker
            assert status == 409 and "could not serve" in body["error"]["message"], body
            _check_flip(c, decode, "prefill", "decode", {"both": 0, "prefill": 2, "decode": 1})
            time.sleep(1.0)

        failed = [a for a in stream.answers if a != reference]
        assert len(stream.answers) >= 10, stream.answers
        assert not failed, failed[:5]

        with urllib.request.urlopen(
            urllib.request.Request(c.url + "/admin/workers", headers=AUTH), timeout=10
        ) as r:
            workers = json.loads(r.read())["workers"]
        roles = {w["worker_id"]: (w["role"], w["state"]) for w in workers}
        assert roles[decode] == ("decode", "serving"), roles
        assert sorted(r for r, _ in roles.values()) == ["decode", "decode", "prefill"]
        c.wait_idle()
        with urllib.request.urlopen(c.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'baton_router_role_changes_total{outcome="done",role="prefill"} 1.0' in text
        assert 'baton_router_role_changes_total{outcome="done",role="decode"} 1.0' in text
        moved = [  # live, or recomputed where live migration cannot run
            float(ln.split()[-1])
            for ln in text.splitlines()
            if ln.startswith("baton_router_migrations_total") and 'reason="role_change"' in ln
        ]
        assert sum(moved) >= 1, moved


def test_up_with_the_planner_flips_towards_the_short_role(tmp_path: Path) -> None:
    """`baton up --planner` held to a TTFT few prompts meet: the planner makes one decode
    worker a prefill worker under the stream, fails no request, and never takes the last
    decode worker."""
    env = {
        "BATON_WINDOW": "1",
        "BATON_HOLD_WINDOWS": "2",
        "BATON_MIN_REQUESTS": "1",
        "BATON_COOLDOWN_WINDOWS": "2",
    }
    args = ("--prefill", "1", "--decode", "2", "--planner", "--ttft-slo", "0.02")
    with cluster(tmp_path, *args, "--tpot-slo", "10", env=env) as c:
        reference = _complete(c)
        with Stream(c, clients=2) as stream:
            deadline = time.monotonic() + 90
            while _health(c)["workers"] != {"both": 0, "prefill": 2, "decode": 1}:
                assert time.monotonic() < deadline, c.logs()
                time.sleep(0.3)
            time.sleep(4)  # windows past the cool-down: the last decode worker stays
        assert _health(c)["workers"] == {"both": 0, "prefill": 2, "decode": 1}
        assert stream.answers and all(a == reference for a in stream.answers), stream.answers
        log = (c.log_dir / "planner.log").read_text()
        assert "flip decode -> prefill (prefill is short): P:D 1:2" in log, log
        assert "; done: decode-" in log, log
        assert "decode has its last worker" in log, log


def test_an_aggregated_cluster_turns_p_d_a_worker_at_a_time(tmp_path: Path) -> None:
    """Three aggregated workers under a stream: one becomes a prefill worker, another a
    decode worker (requests then run disaggregated on them), then both are aggregated
    again; no request fails and every answer is the same."""
    with cluster(tmp_path, "--workers", "3", env={"BATON_ADMIN_API_KEY": ADMIN}) as c:
        reference = _complete(c)
        workers = sorted(_health(c)["worker_ids"])
        with Stream(c, clients=2) as stream:
            for worker_id, role in ((workers[0], "prefill"), (workers[1], "decode")):
                status, body = _flip(c, worker_id, role)
                assert status == 200 and body["previous_role"] == "both", body
            assert _health(c)["workers"] == {"both": 1, "prefill": 1, "decode": 1}
            time.sleep(2.0)  # the stream now runs on the pair
            with urllib.request.urlopen(c.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            placed = [
                ln for ln in text.splitlines() if ln.startswith("baton_router_placements_total")
            ]
            assert any(not ln.endswith(" 0.0") for ln in placed), placed
            status, body = _flip(c, workers[0], "both")  # P's partner stays: fine
            assert status == 200, body
            status, body = _flip(c, workers[1], "both")
            assert status == 200, body
        assert _health(c)["workers"] == {"both": 3, "prefill": 0, "decode": 0}
        assert stream.answers and all(a == reference for a in stream.answers), stream.answers
        c.wait_idle()


def test_a_flip_over_etcd_keeps_one_record_under_the_new_lease(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """With etcd as the registry, the flipped worker's record is replaced under a new
    lease and the old lease revoked without taking the record along: past two lease ttls
    the worker still serves in its new role, and no request failed meanwhile."""
    args = ("--prefill", "1", "--decode", "2", "--registry", etcd_server.url())
    with cluster(tmp_path, *args, env={"BATON_ADMIN_API_KEY": ADMIN}) as c:
        reference = _complete(c)
        with Stream(c, clients=2) as stream:
            decode = _busy_decode_worker(c)
            status, body = _flip(c, decode, "prefill")
            assert status == 200, body
            time.sleep(4.5)  # two lease ttls (cluster.py: --lease-ttl 2) and more
        records = {w.worker_id: w.role for w in c.workers()}
        assert records[decode] == pb.PREFILL and len(records) == 3, records
        assert _health(c)["workers"] == {"both": 0, "prefill": 2, "decode": 1}
        assert stream.answers and all(a == reference for a in stream.answers), stream.answers
        assert _flip(c, decode, "decode")[0] == 200
        assert {w.worker_id: w.role for w in c.workers()}[decode] == pb.DECODE
