"""Hostile input at the router: huge or slow bodies, huge prompts, out-of-range numbers and
invalid Unicode are answered with 4xx at once, never a 500 and never a frozen router."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.router.app import create_app
from baton.services.router.config import RouterConfig
from tests.integration.router_api import MODEL, answered
from tests.integration.test_router_cluster import fake, http_router, router

pytestmark = pytest.mark.timeout(60)

SCRIPT = list(range(40, 48))


async def test_bodies_over_the_limit_are_413(tokenizer: Tokenizer) -> None:
    worker = fake("w0", pb.BOTH, SCRIPT)
    async with router(tokenizer, [worker], max_body_bytes=1000) as client:
        big = {"model": MODEL, "prompt": "x" * 2000, "max_tokens": 1}
        r = await client.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: counted as it arrives
            yield json.dumps(big).encode()

        r = await client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert (await client.post("/v1/completions", json=small)).status_code == 200
        assert answered(await client.get("/metrics"), "/v1/completions", 413) == 2
    assert len(worker.requests) == 1


async def test_a_slow_body_is_408_and_does_not_hold_the_router(tokenizer: Tokenizer) -> None:
    worker = fake("w0", pb.BOTH, SCRIPT)
    await worker.start()
    app = create_app(RouterConfig(body_timeout=0.5), [worker.info()], tokenizer=tokenizer)
    try:
        async with http_router(app) as url, httpx.AsyncClient(base_url=url) as client:
            host, port = url.removeprefix("http://").split(":")
            sock = socket.create_connection((host, int(port)))
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            started = time.monotonic()
            sock.send(head.encode())  # then the body never comes
            # Meanwhile other clients are served.
            assert (await client.get("/health")).status_code == 200
            answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
            assert time.monotonic() - started < 5
            sock.close()
    finally:
        await worker.stop()


async def test_a_huge_prompt_is_refused_by_its_size_without_freezing_others(
    tokenizer: Tokenizer,
) -> None:
    worker = fake("w0", pb.BOTH, SCRIPT)
    await worker.start()
    app = create_app(RouterConfig(), [worker.info()], tokenizer=tokenizer)
    prompt = "lorem ipsum " * 1_000_000  # 12 MB: far more than the context could hold
    try:
        async with http_router(app) as url, httpx.AsyncClient(base_url=url) as client:

            async def health_latency() -> float:
                worst = 0.0
                for _ in range(20):
                    started = time.monotonic()
                    assert (await client.get("/health")).status_code == 200
                    worst = max(worst, time.monotonic() - started)
                    await asyncio.sleep(0.02)
                return worst

            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            big = asyncio.create_task(client.post("/v1/completions", json=body, timeout=30))
            worst = await health_latency()
            r = await big
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert worst < 2.0, f"/health took {worst:.2f}s while a huge prompt was handled"
    finally:
        await worker.stop()
    assert worker.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"min_tokens": 2**40}, "min_tokens"),
        ({"stop_token_ids": [2**33]}, "stop_token_ids"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"prompt": [2**40]}, "prompt"),
        ({"prompt": "caf\ud800"}, "prompt"),
        ({"stop": ["\udfff"]}, "stop"),
    ],
)
async def test_out_of_range_and_invalid_text_are_400(
    tokenizer: Tokenizer, body: dict[str, object], param: str
) -> None:
    worker = fake("w0", pb.BOTH, SCRIPT)
    async with router(tokenizer, [worker]) as client:
        full = {"model": MODEL, "prompt": "x", "max_tokens": 2, **body}
        # json.dumps escapes a lone surrogate as \\udXXX: valid JSON, invalid Unicode.
        raw = json.dumps(full).encode()
        r = await client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        assert param in r.json()["error"]["message"]
    assert worker.requests == []


async def test_invalid_text_in_chat_and_native_bodies_is_400(tokenizer: Tokenizer) -> None:
    worker = fake("w0", pb.BOTH, SCRIPT)
    async with router(tokenizer, [worker]) as client:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud83d"}]}
        native = {"text": "x", "sampling_params": {"top_k": 2**31, "max_new_tokens": 2}}
        for path, body in (("/v1/chat/completions", chat), ("/generate", native)):
            r = await client.post(
                path, content=json.dumps(body), headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (path, r.text)
    assert worker.requests == []


async def test_the_api_description_needs_the_key(tokenizer: Tokenizer) -> None:
    async with router(tokenizer, [], api_key="sk-test") as client:
        assert (await client.get("/openapi.json")).status_code == 401
        r = await client.get("/openapi.json", headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
        assert (await client.get("/health")).status_code == 503  # open: no workers
