"""The router's errors against fake gRPC workers (aggregated mode): OpenAI-style bodies
for bad requests, the API key, no workers, queueing and 429s, worker failures and
timeouts (`router_api.py` has the harness)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from baton.common.tokenizer import Tokenizer
from tests.integration.router_api import (
    CHAT,
    COMPLETION,
    answered,
    cluster,
    events,
    eventually,
    worker,
)

pytestmark = pytest.mark.timeout(30)


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/completions", b"{not json", 400, None, None),
        ("/v1/completions", b"[1, 2]", 400, None, None),
        ("/v1/completions", {**COMPLETION, "max_tokens": "5"}, 400, "max_tokens", None),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", None),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, 400, "temperature", None),
        ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n", None),
        ("/v1/completions", {**COMPLETION, "stream": "yes"}, 400, "stream", None),
        ("/v1/completions", {**COMPLETION, "prompt": [99999]}, 400, "prompt", None),
        ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt", None),
        ("/v1/completions", {**COMPLETION, "prompt": 5}, 400, "prompt", None),
        ("/v1/completions", {**COMPLETION, "stop": 5}, 400, "stop", None),
        ("/v1/completions", {**COMPLETION, "suffix": "x"}, 400, "suffix", None),
        ("/v1/completions", {**COMPLETION, "best_of": 3}, 400, "best_of", None),
        ("/v1/completions", {**COMPLETION, "frobnicate": 1}, 400, "frobnicate", None),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias", None),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"9999": 1}}, 400, "logit_bias", None),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
        ("/v1/completions", {**COMPLETION, "regex": "a("}, 400, "regex", None),
        (
            "/v1/completions",
            {**COMPLETION, "regex": "a", "structured_outputs": {"choice": ["x"]}},
            400,
            "structured_outputs",
            None,
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format.json_schema",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            },
            400,
            "response_format.json_schema",
            None,
        ),
        ("/v1/chat/completions", {**CHAT, "store": True}, 400, "store", None),
        ("/v1/chat/completions", {**CHAT, "audio": {"voice": "x"}}, 400, "audio", None),
        (
            "/v1/chat/completions",
            {**CHAT, "reasoning_effort": "low"},
            400,
            "reasoning_effort",
            None,
        ),
        ("/v1/chat/completions", {**CHAT, "service_tier": "flex"}, 400, "service_tier", None),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice", None),
        ("/v1/completions", {"prompt": "x"}, 400, "model", None),
        ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "model", "model_not_found"),
        (
            "/v1/completions",
            {**COMPLETION, "max_tokens": 10**6},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {**COMPLETION, "prompt": [5] * 5000},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, None, None),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0].type",
            None,
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", None),
        (
            "/v1/chat/completions",
            {**CHAT, "min_tokens": 9, "max_tokens": 3},
            400,
            "min_tokens",
            None,
        ),
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"bogus": 1}},
            400,
            "sampling_params.bogus",
            None,
        ),
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"top_p": 2.0}},
            400,
            "sampling_params.top_p",
            None,
        ),
        ("/generate", {"input_ids": []}, 400, "input_ids", None),
        ("/generate", {"text": "x", "input_ids": [1]}, 400, "text", None),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 2}},
            400,
            "sampling_params.regex",
            None,
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    tokenizer: Tokenizer,
    script: list[int],
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    assert error["code"] == code
    assert fake.requests == []  # nothing bad ever reaches a worker


async def test_api_key(tokenizer: Tokenizer, script: list[int]) -> None:
    async with cluster(tokenizer, [worker(script)], api_key="sk-secret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-secret"}):
            r = await client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.post(
            "/v1/completions", content=b"{bad", headers={"content-type": "application/json"}
        )
        assert r.status_code == 401  # unauthenticated clients learn nothing about the body
        assert (await client.get("/v1/models")).status_code == 401
        ok = {"Authorization": "Bearer sk-secret"}
        r = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1}, headers=ok)
        assert r.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 401  # unless --metrics-public
        assert (await client.get("/metrics", headers=ok)).status_code == 200


async def test_no_workers_is_503(tokenizer: Tokenizer) -> None:
    async with cluster(tokenizer, []) as client:
        r = await client.get("/health")
        assert r.status_code == 503
        r = await client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "service_unavailable"


async def test_over_the_concurrency_limit_queues_then_429(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    fake = worker(script, first_delay=0.5)
    limits = {"max_concurrent_requests": 1, "max_queued_requests": 1}
    async with cluster(tokenizer, [fake], **limits) as client:
        body = {**COMPLETION, "max_tokens": 2}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await eventually(lambda: len(fake.requests) == 1)
        queued = asyncio.create_task(client.post("/v1/completions", json=body))

        async def queued_one() -> bool:
            return "baton_router_requests_queued 1.0" in (await client.get("/metrics")).text

        await eventually(queued_one)  # the second request waits in line
        r = await client.post("/v1/completions", json=body)  # the line is full
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert answered(await client.get("/metrics"), "/v1/completions", 429) == 1
        assert (await first).status_code == 200
        assert (await queued).status_code == 200  # it kept its place and ran next
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200  # the slots were given back


async def test_a_request_that_waits_too_long_is_429(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    fake = worker(script, first_delay=1.0)
    limits = {"max_concurrent_requests": 1, "queue_timeout": 0.2}
    async with cluster(tokenizer, [fake], **limits) as client:
        body = {**COMPLETION, "max_tokens": 2}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await eventually(lambda: len(fake.requests) == 1)
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"]
        assert "0.2s" in r.json()["error"]["message"]
        assert (await first).status_code == 200


async def test_worker_failure_is_502_or_an_sse_error(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    async with cluster(tokenizer, [worker(script, fail="at_start")]) as client:
        r = await client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    async with cluster(tokenizer, [worker(script, fail="after_first")]) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        chunks = events(r.text)
        assert chunks[0]["choices"][0]["text"] == "Hello"
        assert "error" in chunks[-2] and chunks[-1] == "[DONE]"


async def test_request_timeout_aborts_the_worker(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script, first_delay=5.0)
    async with cluster(tokenizer, [fake], request_timeout=0.3) as client:
        r = await client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        await eventually(lambda: fake.aborted == [fake.requests[0].request_id])


async def test_models_health_and_metrics(tokenizer: Tokenizer, script: list[int]) -> None:
    async with cluster(tokenizer, [worker(script)], served_model_name="tiny") as client:
        r = await client.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["tiny"]
        assert (await client.get("/health")).json()["workers"]["both"] == 1
        await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        text = (await client.get("/metrics")).text
    labels = 'endpoint="/v1/completions",model_name="tiny"'
    assert f'baton_router_requests_total{{{labels},status="200"}} 1.0' in text
    assert f'baton_router_requests_total{{{labels},status="404"}} 1.0' in text
    assert f"baton_router_time_to_first_token_seconds_count{{{labels}}} 1.0" in text
    assert f"baton_router_e2e_request_latency_seconds_count{{{labels}}} 1.0" in text
    assert f"baton_router_time_per_output_token_seconds_count{{{labels}}} 1.0" in text
    assert f"baton_router_inter_token_latency_seconds_count{{{labels}}} 2.0" in text
    assert 'baton_router_requests_in_flight{model_name="tiny"} 0.0' in text
    assert 'baton_router_workers{role="both"} 1.0' in text
