"""Disaggregated clusters of real processes: greedy output equals the engine's, in every shape
and backend; failures end cleanly; nothing received is trusted."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest

from baton.common.engine import Engine
from baton.common.models.tiny import default_model_path
from baton.common.sampling import GrammarSpec, SamplingParams
from tests.integration.cluster import cluster

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
_EXPECTED: dict[tuple[int, ...], list[int]] = {}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(10, 2000) for _ in range(40)]
    out = [[rng.randrange(10, 2000) for _ in range(n)] for n in (1, 15, 70, 130)]
    out += [shared + [rng.randrange(10, 2000) for _ in range(n)] for n in (3, 21)]
    return out


def expected(prompt: list[int]) -> list[int]:
    if not _EXPECTED:
        with Engine(default_model_path()) as engine:
            ps = prompts()
            outs = engine.generate(
                ps, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
            )
            _EXPECTED.update({tuple(p): o.output_ids for p, o in zip(ps, outs, strict=True)})
    return _EXPECTED[tuple(prompt)]


# structured output: P samples the first token under the grammar, D continues it
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}
STRUCTURED = {"temperature": 1.0, "sampling_seed": 9, "max_new_tokens": 40, "json_schema": SCHEMA}


def expected_structured(prompt: list[int]) -> list[int]:
    params = SamplingParams(
        temperature=1.0,
        seed=9,
        max_new_tokens=40,
        grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)),
    )
    with Engine(default_model_path()) as engine:
        return engine.generate([prompt], params)[0].output_ids


def generate(c, prompt: list[int]) -> dict:  # type: ignore[no-untyped-def]
    status, body = c.post(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        },
        headers={"authorization": "Bearer k"},
    )
    assert status == 200, body
    return body


SHAPES = [
    # (label, baton up arguments)
    (
        "1P1D-tcp-page1",
        ["--prefill", "1", "--decode", "1", "--transfer-backend", "tcp", "--page-size", "1"],
    ),
    (
        "1P2D-ucx-page16-chunked-dradix",
        [
            "--prefill",
            "1",
            "--decode",
            "2",
            "--transfer-backend",
            "ucx",
            "--page-size",
            "16",
            "--chunked-prefill-size",
            "32",
            "--decode-radix-cache",
        ],
    ),
    (
        "2P1D-tcp-page16-dradix",
        [
            "--prefill",
            "2",
            "--decode",
            "1",
            "--transfer-backend",
            "tcp",
            "--page-size",
            "16",
            "--decode-radix-cache",
            "--kv-verify-checksum",
        ],
    ),
    (
        "1P1D-ucx-page1-chunked",
        [
            "--prefill",
            "1",
            "--decode",
            "1",
            "--transfer-backend",
            "ucx",
            "--page-size",
            "1",
            "--chunked-prefill-size",
            "16",
        ],
    ),
]


def _ucx_usable() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.parametrize(("label", "args"), SHAPES, ids=[s[0] for s in SHAPES])
def test_pd_greedy_matches_engine(tmp_path: Path, label: str, args: list[str]) -> None:
    if "ucx" in args and not _ucx_usable():
        pytest.skip("ucxx is not importable here")
    with cluster(tmp_path, *args, "--api-key", "k") as c:
        ps = prompts()
        # twice, concurrently: the second round hits prefix caches on both sides
        for _ in range(2):
            with cf.ThreadPoolExecutor(4) as pool:
                bodies = list(pool.map(lambda p: generate(c, p), ps))
            for p, body in zip(ps, bodies, strict=True):
                assert body["output_ids"] == expected(p), f"{label}: prompt of {len(p)}"
                assert body["meta_info"]["finish_reason"]["type"] == "length"
        if label == "1P1D-tcp-page1":  # token-exact with the aggregated engine under a grammar
            status, body = c.post(
                "/generate",
                {"input_ids": ps[2], "sampling_params": STRUCTURED},
                headers={"authorization": "Bearer k"},
            )
            assert status == 200, body
            assert body["output_ids"] == expected_structured(ps[2])
            assert set(json.loads(body["text"])) == {"n", "ok"}
        stats = c.wait_idle()
        assert all(s.pages_in_use == 0 for s in stats)


def test_fake_backend_failures_end_cleanly(tmp_path: Path) -> None:
    """Every second room fails on the sender: clients get a retry's success or a clean error,
    and both workers go back to zero held pages."""
    args = [
        "--prefill",
        "1",
        "--decode",
        "1",
        "--transfer-backend",
        "fake",
        "--transfer-fault",
        "fail:every=2",
        "--room-timeout",
        "5",
    ]
    with cluster(tmp_path, *args) as c:
        ok = errors = 0
        for p in prompts():
            status, body = c.post(
                "/generate",
                {
                    "input_ids": p,
                    "sampling_params": {
                        "temperature": 0,
                        "max_new_tokens": MAX_NEW,
                        "ignore_eos": True,
                    },
                },
            )
            if status == 200:
                ok += 1
                assert body["output_ids"] == expected(p)
            else:
                errors += 1
                assert 500 <= status < 600 and "error" in body, body
        assert ok >= 1, "retries on another pair should rescue some requests"
        c.wait_idle()
    with cluster(
        tmp_path, *args[:-4], "--transfer-fault", "drop:every=1", "--room-timeout", "1"
    ) as c:
        t = time.monotonic()
        status, body = c.post(
            "/generate",
            {"input_ids": prompts()[1], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
        )
        assert status >= 500 and "error" in body
        assert time.monotonic() - t < 30, "a dropped room must fail at its deadline"
        c.wait_idle()


def test_killing_prefill_mid_transfer(tmp_path: Path) -> None:
    args = [
        "--prefill",
        "2",
        "--decode",
        "1",
        "--transfer-backend",
        "fake",
        "--transfer-fault",
        "delay:ms=1500",
        "--room-timeout",
        "6",
    ]
    with cluster(tmp_path, *args) as c:
        prefills = [w for w in c.workers() if w.role == 2]  # PREFILL
        assert len(prefills) == 2
        body = {
            "input_ids": prompts()[2],
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        }
        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(c.post, "/generate", body, 60) for _ in range(4)]
            time.sleep(0.8)  # rooms are now transferring (each takes 1.5 s)
            victim = c.worker_pid(prefills[0].grpc_address)
            os.kill(victim, signal.SIGKILL)
            t = time.monotonic()
            results = [f.result() for f in futures]
        assert time.monotonic() - t < 20, "affected requests must be answered by the deadline"
        for status, resp in results:
            assert status == 200 or "error" in resp
        deadline = time.monotonic() + 15
        while len([w for w in c.workers() if w.role == 2]) != 1:
            assert time.monotonic() < deadline, "the dead prefill worker must leave routing"
            time.sleep(0.3)
        status, resp = c.post("/generate", body)
        assert status == 200 and resp["output_ids"] == expected(prompts()[2])
        for w in c.workers():
            if w.role == 3:  # DECODE frees the rooms of the dead peer
                deadline = time.monotonic() + 15
                while c.worker_stats(w.grpc_address).pages_in_use:
                    assert time.monotonic() < deadline
                    time.sleep(0.3)


def tcp_address(transfer_address: str) -> str:
    """The tcp listener in a decode worker's transfer address (an `auto` offer lists one)."""
    if transfer_address.startswith("auto:"):
        from baton.common.transfer.auto import decode_address

        return decode_address(transfer_address).addresses.get("tcp", "")
    return transfer_address


def test_garbage_on_kv_ports_is_dropped(tmp_path: Path) -> None:
    with cluster(tmp_path, "--prefill", "1", "--decode", "1") as c:
        rng = random.Random(0)
        for w in c.workers():
            for address in (w.kv_control_address, tcp_address(w.transfer_address)):
                if not address:
                    continue
                host, port = address.rsplit(":", 1)
                for payload in (
                    bytes(rng.randrange(256) for _ in range(512)),
                    (100 * 1024 * 1024).to_bytes(8, "big") + b"x" * 64,
                    b"\x00" * 10,
                ):
                    with socket.create_connection((host, int(port)), timeout=5) as s:
                        try:
                            s.sendall(payload)
                            s.settimeout(0.5)
                            s.recv(16)
                        except OSError:
                            pass
        p = prompts()[3]
        assert generate(c, p)["output_ids"] == expected(p)
        c.wait_idle()


def test_stream_interval_streams_the_same_tokens_in_fewer_chunks(tmp_path: Path) -> None:
    """`--stream-interval 4`: after its first message a stream carries four tokens at a
    time, so the router relays (and the client reads) a quarter of the messages; the
    tokens and the text are the same."""
    import urllib.request

    p = prompts()[2]
    with cluster(tmp_path, "--prefill", "1", "--decode", "1", "--stream-interval", "4") as c:
        body = generate(c, p)
        assert body["output_ids"] == expected(p)
        request = {
            "model": c.model_name,
            "prompt": p,
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        req = urllib.request.Request(
            c.url + "/v1/completions",
            data=json.dumps(request).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            events = [
                json.loads(line[6:])
                for line in resp.read().decode().splitlines()
                if line.startswith("data: {")
            ]
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert streamed == body["text"]
        # P's first token, D's first message (token 2), then 10 tokens four at a time
        assert len(events) <= 2 + -(-(MAX_NEW - 2) // 4) + 1, len(events)
