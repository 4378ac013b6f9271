"""Shared pieces of the router API tests: a router app in-process behind httpx's ASGI
transport, fake gRPC workers that "generate" a fixed script of real token ids, and
readers of SSE bodies and /metrics."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.benchmarks.fake_worker import FakeBehavior, FakeWorker
from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.router.app import create_app
from baton.services.router.config import RouterConfig

MODEL = "tiny-llama-v1"
TEXT = "Hello world, the cat sat on the mat."
TIMINGS = pb.Timings(queue=0.25, prefill=0.5, kv_transfer=0.0, decode_admission=0.0)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": MODEL, "prompt": "x"}


@asynccontextmanager
async def cluster(
    tokenizer: Tokenizer,
    workers: list[FakeWorker],
    layout: Callable[[FakeWorker], pb.KVLayout | None] = lambda w: None,
    **config: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """The router app over ASGI, with `workers` started, then registered statically (each
    with its KV `layout`)."""
    for worker in workers:
        await worker.start()
    infos = [w.info(layout(w)) for w in workers]  # once started: their ports are known
    app = create_app(RouterConfig(**config), infos, tokenizer=tokenizer)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://router"
            ) as client,
        ):
            yield client
    finally:
        for worker in workers:
            await worker.stop()


def worker(script: list[int], **behavior: Any) -> FakeWorker:
    behavior.setdefault("timings", TIMINGS)
    return FakeWorker("w0", pb.BOTH, FakeBehavior(script=script, **behavior))


def events(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, "[DONE]" kept as a string."""
    out = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    """Wait until `predicate()` (or the awaitable it returns) holds."""
    for _ in range(int(timeout / 0.02)):
        held = predicate()
        if await held if inspect.isawaitable(held) else held:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def answered(metrics: httpx.Response, endpoint: str, status: int) -> float:
    """How many requests to `endpoint` the router answered with `status` (its /metrics)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics.text)
        for sample in family.samples
        if sample.name == "baton_router_requests_total"
        and sample.labels.get("endpoint") == endpoint
        and sample.labels.get("status") == str(status)
    )
