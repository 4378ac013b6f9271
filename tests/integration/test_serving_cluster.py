"""Aggregated workers behind the router, as real processes: what an OpenAI client sees."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from baton.common.engine import Engine
from baton.common.models.tiny import default_model_path
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pbg
from baton.common.sampling import SamplingParams
from baton.common.tokenizer import Tokenizer
from tests.integration.cluster import Cluster, cluster

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def rr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(
        tmp_path_factory.mktemp("rr"), "--workers", "2", "--policy", "round_robin", "--api-key", KEY
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def engine_text(tok: Tokenizer, ids: list[int], n: int) -> str:
    with Engine(default_model_path()) as engine:
        out = engine.generate(
            [ids],
            SamplingParams(
                temperature=0, max_new_tokens=n, stop_token_ids=sorted(tok.eos_token_ids)
            ),
        )
    return tok.decode(out[0].output_ids)


def test_openai_client_matches_offline_engine(rr: Cluster, tok: Tokenizer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=rr.url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    prompt = "The quick brown fox jumps over"
    want = engine_text(tok, tok.encode(prompt), 16)
    got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == want
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == want
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    want_chat = engine_text(tok, tok.apply_chat_template(messages), 16)
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    assert chat.choices[0].message.content == want_chat
    parts = [
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(parts) == want_chat


def test_round_robin_spreads_requests(rr: Cluster) -> None:
    time.sleep(0.6)  # workers publish their statistics every 0.25 s
    before = {w.worker_id: rr.worker_stats(w.grpc_address).prompt_tokens for w in rr.workers()}
    for i in range(6):
        status, _ = rr.post(
            "/v1/completions",
            {"model": "tiny-llama-v1", "prompt": f"hi {i}", "max_tokens": 2},
            headers=AUTH,
        )
        assert status == 200
    time.sleep(0.6)
    after = {w.worker_id: rr.worker_stats(w.grpc_address).prompt_tokens for w in rr.workers()}
    assert all(after[w] > before[w] for w in before), (before, after)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (json.dumps({"model": "tiny-llama-v1", "prompt": "x", "max_tokens": "many"}).encode(), 400),
        (json.dumps({"model": "tiny-llama-v1", "prompt": "x", "max_tokens": -1}).encode(), 400),
        (json.dumps({"model": "tiny-llama-v1", "prompt": "word " * 5000}).encode(), 400),
        (json.dumps({"model": "no-such-model", "prompt": "x"}).encode(), 404),
        (json.dumps({"model": "tiny-llama-v1", "prompt": "x", "temperature": -3}).encode(), 400),
    ],
)
def test_bad_input_gets_openai_4xx(rr: Cluster, body: bytes, status: int) -> None:
    req = urllib.request.Request(
        rr.url + "/v1/completions", data=body, headers={"content-type": "application/json", **AUTH}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == status
    error = json.loads(err.value.read())["error"]
    assert error["message"] and "type" in error
    ok, _ = rr.post(
        "/v1/completions",
        {"model": "tiny-llama-v1", "prompt": "still up?", "max_tokens": 2},
        headers=AUTH,
    )
    assert ok == 200


def test_auth_api_key_and_cluster_token(rr: Cluster) -> None:
    status, body = rr.post("/v1/completions", {"model": "tiny-llama-v1", "prompt": "x"})
    assert status == 401 and "error" in body
    worker = rr.workers()[0]

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(worker.grpc_address) as ch:
            try:
                await pbg.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    assert asyncio.run(call()) == grpc.StatusCode.UNAUTHENTICATED


def test_disconnect_mid_stream_frees_the_worker(rr: Cluster) -> None:
    body = json.dumps(
        {
            "model": "tiny-llama-v1",
            "prompt": "Once upon a time",
            "stream": True,
            "max_tokens": 4000,
            "ignore_eos": True,
        }
    ).encode()
    host, port = "127.0.0.1", rr.port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while got.count(b"data:") < 5:
            got += s.recv(4096)
    # the client is gone: nothing may stay running or held on any worker
    rr.wait_idle(timeout=20)


def test_killed_worker_leaves_routing(rr: Cluster) -> None:
    """Last in this module: it kills one of the two workers."""
    workers = rr.workers()
    assert len(workers) == 2
    victim = workers[0]
    pid = None
    for log in rr.log_dir.glob("worker-*.log"):
        for line in log.read_text().splitlines():
            if f"grpc={victim.grpc_address} " in line and "BATON_WORKER_PID=" in line:
                pid = int(line.split("BATON_WORKER_PID=")[1].split()[0])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # lease 2 s in tests
    while len(rr.workers()) != 1:
        assert time.monotonic() < deadline, "the dead worker is still registered"
        time.sleep(0.2)
    for i in range(4):
        status, _ = rr.post(
            "/v1/completions",
            {"model": "tiny-llama-v1", "prompt": f"after {i}", "max_tokens": 3},
            headers=AUTH,
        )
        assert status == 200


def test_cache_aware_sends_a_shared_prefix_to_one_worker(tmp_path: Path) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(10, 2000) for _ in range(256)]
    with cluster(tmp_path, "--workers", "2", "--policy", "cache_aware", "--page-size", "16") as c:
        for i in range(6):
            status, _ = c.post(
                "/generate",
                {"input_ids": [*prefix, 100 + i], "sampling_params": {"max_new_tokens": 2}},
            )
            assert status == 200
        time.sleep(0.6)  # workers publish their statistics every 0.25 s
        hits = sorted(c.worker_stats(w.grpc_address).prefix_hit_tokens for w in c.workers())
        assert hits[0] == 0 and hits[1] >= 5 * 256, hits
