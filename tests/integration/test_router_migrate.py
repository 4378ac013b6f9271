"""POST /admin/migrate with fake workers, in process (issue 41 item 1): a running stream
moves to another worker on purpose and continues where it stood, with no gap, repeat or
loss; the endpoint refuses what it cannot do with the right status."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.top import parse
from benchmarks.fake_worker import FakeWorker
from tests.integration.router_api import eventually
from tests.integration.test_router_cluster import complete, fake, router, sse

pytestmark = pytest.mark.timeout(30)

SCRIPT = list(range(40, 72))  # 32 distinct tokens: a resumed stream shows where it resumed
ADMIN = "admin-migrate-key"
AUTH = {"authorization": f"Bearer {ADMIN}"}


async def _migrate(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/admin/migrate", json=body, headers=AUTH)


async def _running(client: httpx.AsyncClient, worker: FakeWorker, tokens: int) -> asyncio.Task:
    """A streamed completion started, once `worker` is generating it."""
    task = asyncio.create_task(complete(client, max_tokens=tokens, stream=True, temperature=0.7))
    await eventually(lambda: len(worker.requests) == 1)
    await asyncio.sleep(0.15)  # a few tokens passed on
    return task


async def test_a_stream_moves_to_another_worker_and_continues_where_it_stood(
    tokenizer: Tokenizer,
) -> None:
    source = fake("w0", pb.BOTH, SCRIPT, delay=0.03)
    target = fake("w1", pb.BOTH, SCRIPT, delay=0.01)
    workers = [source, target]
    async with router(tokenizer, workers, policy="round_robin", admin_api_key=ADMIN) as client:
        task = await _running(client, source, 24)
        request_id = source.requests[0].request_id
        r = await _migrate(client, request_ids=[request_id, "no-such-request"])
        assert r.status_code == 200, r.text
        (move,) = r.json()["moved"]
        assert r.json()["not_running"] == ["no-such-request"]
        assert move["from"] == "w0" and move["to"] == "w1" and move["kind"] == "recompute"
        assert 0 < move["tokens"] < 24, move
        chunks = sse((await task).text)
        metrics = (await client.get("/metrics")).text
    assert "error" not in chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(SCRIPT[:24])
    (first,), (resumed,) = source.requests, target.requests
    done = move["tokens"]
    assert list(resumed.input_ids) == [*first.input_ids, *SCRIPT[:done]]
    assert resumed.sampling.output_offset == done and resumed.sampling.max_new_tokens == 24 - done
    assert resumed.sampling.seed == first.sampling.seed
    assert request_id in source.aborted  # the source freed the request
    assert 'baton_router_migrations_total{kind="recompute",reason="admin"} 1.0' in metrics
    assert 'baton_router_migrations_total{kind="live",reason="admin"} 0.0' in metrics
    assert "baton_router_migration_stall_seconds_count 1.0" in metrics
    samples = parse(metrics)
    cutover = samples[("baton_router_migration_cutover_seconds_sum", frozenset())]
    assert samples[("baton_router_migration_cutover_seconds_count", frozenset())] == 1.0
    # the hand-off is one of the gaps the stall's longest is taken over
    assert 0 < cutover <= samples[("baton_router_migration_stall_seconds_sum", frozenset())]
    assert 'baton_router_reruns_total{kind="migration"} 0.0' in metrics  # no failure


async def test_every_stream_of_a_decode_worker_moves_through_a_prefill_worker(
    tokenizer: Tokenizer,
) -> None:
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    source = fake("d0", pb.DECODE, SCRIPT, delay=0.03)
    spare = fake("d1", pb.DECODE, SCRIPT, delay=0.01)
    target = fake("d2", pb.DECODE, SCRIPT, delay=0.01)
    workers = [prefill, source, spare, target]
    async with router(
        tokenizer, workers, decode_policy="round_robin", admin_api_key=ADMIN
    ) as client:
        tasks = [asyncio.create_task(complete(client, max_tokens=20)) for _ in range(3)]
        await eventually(lambda: len(source.requests) >= 1 and len(prefill.requests) == 3)
        await asyncio.sleep(0.15)
        on_source = len(source.requests)
        r = await _migrate(client, worker_id="d0", to="d2")
        assert r.status_code == 200, r.text
        assert len(r.json()["moved"]) == on_source
        assert {m["to"] for m in r.json()["moved"]} == {"d2"}
        answers = await asyncio.gather(*tasks)
        r = await _migrate(client, worker_id="d0")  # nothing runs there any more
        assert r.status_code == 200 and r.json()["moved"] == [], r.text
    for answer in answers:
        assert answer.json()["choices"][0]["text"] == tokenizer.decode(SCRIPT[:20]), answer.text
    moved_in = [r for r in target.requests if r.request_id.endswith("-retry1")]
    assert len(moved_in) == on_source
    # The resumed runs went through P again: it computed prompt plus output so far.
    assert len(prefill.requests) == 3 + on_source
    assert sorted(source.aborted) == sorted(r.request_id for r in source.requests)


async def test_migrate_refuses_what_it_cannot_do(tokenizer: Tokenizer) -> None:
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    only = fake("d0", pb.DECODE, SCRIPT, delay=0.05)
    async with router(tokenizer, [prefill, only], admin_api_key=ADMIN) as client:
        assert (await client.post("/admin/migrate", json={"worker_id": "d0"})).status_code == 401
        for body in (
            {},
            {"request_ids": ["a"], "worker_id": "d0"},
            {"request_ids": []},
            {"request_ids": [""]},
            {"request_ids": "a"},
            {"worker_id": "d0", "live": True},
        ):
            r = await _migrate(client, **body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert (await _migrate(client, worker_id="d9")).status_code == 404
        assert (await _migrate(client, worker_id="d0", to="d9")).status_code == 404
        assert (await _migrate(client, worker_id="d0", to="p0")).status_code == 409
        task = asyncio.create_task(complete(client, max_tokens=20))
        await eventually(lambda: len(only.requests) == 1)
        r = await _migrate(client, worker_id="d0")  # no other decode worker
        assert r.status_code == 409 and r.json()["error"]["type"] == "conflict", r.text
        r = await _migrate(client, worker_id="d0", to="d0")
        assert r.status_code == 409, r.text
        answer = await task  # refused moves leave the stream alone
        assert answer.json()["choices"][0]["text"] == tokenizer.decode(SCRIPT[:20])
    assert only.aborted == []
