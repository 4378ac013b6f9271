"""The router's side of a trace, with fake workers in-process: a migrated stream's trace
shows both decode workers, and a refused request's trace says so. (A real 1P1D trace,
with the workers' spans: test_observe_cluster.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from tests.integration.otlp_receiver import OTLPReceiver
from tests.integration.test_router_cluster import complete, fake, router

pytestmark = pytest.mark.timeout(30)

SCRIPT = list(range(40, 72))
ERROR = 2  # OTLP's status code for an error


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    receiver = OTLPReceiver()
    try:
        yield receiver
    finally:
        receiver.stop()


def _traceparent() -> tuple[str, dict[str, str]]:
    trace_id = os.urandom(16).hex()
    return trace_id, {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}


async def test_a_migrated_stream_shows_both_decode_workers(
    tokenizer: Tokenizer, receiver: OTLPReceiver
) -> None:
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    dying = fake("d0", pb.DECODE, SCRIPT, fail="after_first", fail_after=3, delay=0.01)
    healthy = fake("d1", pb.DECODE, SCRIPT)
    trace_id, headers = _traceparent()
    workers = [prefill, dying, healthy]
    config = {"decode_policy": "round_robin", "otlp_traces_endpoint": receiver.endpoint}
    async with router(tokenizer, workers, **config) as client:
        body = {"model": "tiny-llama-v1", "prompt": "x", "max_tokens": 10}
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
    # the router's lifespan ended: its spans were flushed
    spans = receiver.wait_for(trace_id, {"baton.router.decode"}, timeout=5)
    (request,) = [s for s in spans if s.name == "POST /v1/completions"]
    calls = sorted(
        (s for s in spans if s.name in ("baton.router.prefill", "baton.router.decode")),
        key=lambda s: s.start_ns,
    )
    seen = [(s.name, s.attributes["baton.worker_id"], s.attributes["baton.attempt"]) for s in calls]
    assert sorted(seen) == [
        ("baton.router.decode", "d0", 0),
        ("baton.router.decode", "d1", 1),  # the migration, on the other decode worker
        ("baton.router.prefill", "p0", 0),
        ("baton.router.prefill", "p0", 1),
    ]
    assert all(c.parent_id == request.span_id for c in calls)
    kinds = {(s.attributes["baton.worker_id"], s.attributes["baton.attempt_kind"]) for s in calls}
    assert kinds == {("p0", "first"), ("d0", "first"), ("p0", "migration"), ("d1", "migration")}
    (rerun,) = [s for s in spans if s.name == "baton.router.rerun"]  # the back-off, explained
    assert (
        rerun.parent_id == request.span_id and rerun.attributes["baton.attempt_kind"] == "migration"
    )
    assert "d0" in str(rerun.attributes["baton.rerun_reason"])
    assert rerun.end_ns <= min(c.start_ns for c in calls if c.attributes["baton.attempt"] == 1)
    (lost,) = [c for c in calls if c.attributes["baton.worker_id"] == "d0"]
    assert lost.status_code == ERROR and lost.end_ns <= request.end_ns


async def test_a_refused_request_ends_its_trace_with_the_refusal(
    tokenizer: Tokenizer, receiver: OTLPReceiver
) -> None:
    slow = fake("w0", pb.BOTH, SCRIPT, delay=0.2)
    trace_id, headers = _traceparent()
    config = {
        "otlp_traces_endpoint": receiver.endpoint,
        "max_concurrent_requests": 1,
        "max_queued_requests": 0,
    }
    async with router(tokenizer, [slow], **config) as client:
        running = asyncio.create_task(complete(client, max_tokens=3))
        while not slow.requests:
            await asyncio.sleep(0.01)
        body = {"model": "tiny-llama-v1", "prompt": "x", "max_tokens": 3}
        refused = await client.post("/v1/completions", json=body, headers=headers)
        assert refused.status_code == 429
        assert (await running).status_code == 200
    spans = receiver.wait_for(trace_id, {"POST /v1/completions"}, timeout=5)
    (request,) = [s for s in spans if s.name == "POST /v1/completions"]
    (admission,) = [s for s in spans if s.name == "baton.router.admission"]
    assert request.attributes["http.response.status_code"] == 429
    assert request.status_code != ERROR  # a refusal is no failure of the server
    assert "queue" in str(request.attributes["baton.refusal"])
    assert admission.parent_id == request.span_id and admission.status_code == ERROR
    names = {s.name for s in spans}
    assert names == {"POST /v1/completions", "baton.router.prepare", "baton.router.admission"}
