"""The router's /health: joined workers against the ones it expects (`--expect-workers`)."""

from __future__ import annotations

import pytest

from baton.benchmarks.fake_worker import FakeWorker
from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.router.config import WorkerCounts
from tests.integration.router_api import cluster

pytestmark = pytest.mark.timeout(30)


def workers(*ids: str) -> list[FakeWorker]:
    return [FakeWorker(i, pb.BOTH) for i in ids]


async def test_without_an_expectation_health_counts_the_joined_workers(
    tokenizer: Tokenizer,
) -> None:
    async with cluster(tokenizer, workers("w0", "w1")) as client:
        r = await client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["expected"] is None
    assert body["workers"] == {"both": 2, "prefill": 0, "decode": 0}
    assert body["worker_ids"] == ["w0", "w1"]


async def test_a_usable_cluster_short_of_its_workers_is_partial_but_serves(
    tokenizer: Tokenizer,
) -> None:
    """200, so load balancers keep it; the body says who is missing."""
    expect = WorkerCounts(both=3)
    async with cluster(tokenizer, workers("w0", "w1"), expect_workers=expect) as client:
        r = await client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "partial" and "1 both" in body["detail"]
    assert body["expected"] == {"both": 3, "prefill": 0, "decode": 0}
    assert body["workers"]["both"] == 2


async def test_an_unusable_cluster_stays_503_and_shows_what_it_expects(
    tokenizer: Tokenizer,
) -> None:
    expect = WorkerCounts(prefill=1, decode=2)
    async with cluster(tokenizer, [], expect_workers=expect) as client:
        r = await client.get("/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable" and body["worker_ids"] == []
    assert body["expected"] == {"both": 0, "prefill": 1, "decode": 2}


async def test_every_expected_worker_joined_is_ok(tokenizer: Tokenizer) -> None:
    expect = WorkerCounts(both=2)
    async with cluster(tokenizer, workers("w0", "w1"), expect_workers=expect) as client:
        body = (await client.get("/health")).json()
    assert body["status"] == "ok" and "detail" not in body
