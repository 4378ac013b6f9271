"""What clients nobody on the project wrote send and expect (issue #42): guidellm's stream
options, line splitters that know Unicode, lower-case bearer schemes, scrapers without a key.

The router runs in-process against fake gRPC workers (`router_api`).
"""

from __future__ import annotations

import json

import pytest

from baton.common.tokenizer import Tokenizer
from tests.integration.router_api import CHAT, MODEL, cluster, events, worker

pytestmark = pytest.mark.timeout(30)


async def test_continuous_usage_stats_puts_usage_in_every_chunk(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    # guidellm 0.8's request: include_usage and continuous_usage_stats, as vLLM honours them
    async with cluster(tokenizer, [worker(script, tokens_per_chunk=2)]) as client:
        r = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Say it",
                "max_tokens": 6,
                "stop": None,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
    assert r.status_code == 200, r.text
    *chunks, done = events(r.text)
    assert done == "[DONE]"
    prompt_len = len(tokenizer.encode("Say it"))
    usages = [c["usage"] for c in chunks]
    assert [u["completion_tokens"] for u in usages] == [2, 4, 6, 6]  # three deltas, the last
    assert all(u["prompt_tokens"] == prompt_len for u in usages)
    assert all(u["total_tokens"] == prompt_len + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []


async def test_continuous_usage_stats_in_chat_chunks_from_the_role_on(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    # guidellm 0.8's chat request, as its ChatCompletionsRequestHandler builds it
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 3,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    async with cluster(tokenizer, [worker(script)]) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    *chunks, _ = events(r.text)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []  # include_usage's closing chunk


async def test_continuous_usage_stats_alone_still_puts_usage_in_every_chunk(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    async with cluster(tokenizer, [worker(script)]) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
        )
    *chunks, _ = events(r.text)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # no closing chunk


async def test_stream_without_continuous_usage_has_usage_only_at_the_end(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    async with cluster(tokenizer, [worker(script)]) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 3, "stream": True},
        )
    assert all("usage" not in c for c in events(r.text)[:-1])


async def test_unicode_line_separators_stay_inside_one_sse_line(tokenizer: Tokenizer) -> None:
    text = "one\u2028two\x85three\u2029four"
    script = tokenizer.encode(text, add_special_tokens=False)
    async with cluster(tokenizer, [worker(script, tokens_per_chunk=len(script))]) as client:
        payload = {**CHAT, "max_tokens": len(script), "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            # httpx's aiter_lines splits on every Unicode line break, as str.splitlines does
            lines = [line async for line in r.aiter_lines()]
    data = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in data), data
    chunks = events("\n".join(data))
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert content == text


async def test_bearer_scheme_is_case_insensitive(tokenizer: Tokenizer, script: list[int]) -> None:
    async with cluster(tokenizer, [worker(script)], api_key="k" * 20) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = await client.get("/v1/models", headers={"Authorization": f"{scheme} {'k' * 20}"})
            assert r.status_code == 200, (scheme, r.text)
        for wrong in ("Bearer " + "k" * 19, "Basic " + "k" * 20, "bearer", "k" * 20):
            r = await client.get("/v1/models", headers={"Authorization": wrong})
            assert r.status_code == 401, wrong
    async with cluster(tokenizer, [worker(script)], admin_api_key="a" * 20) as client:
        r = await client.post("/flush_cache", headers={"Authorization": "bearer " + "a" * 20})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("public", [False, True])
async def test_metrics_need_the_api_key_unless_public(
    tokenizer: Tokenizer, script: list[int], public: bool
) -> None:
    async with cluster(
        tokenizer, [worker(script)], api_key="k" * 20, metrics_public=public
    ) as client:
        anonymous = await client.get("/metrics")
        keyed = await client.get("/metrics", headers={"Authorization": "Bearer " + "k" * 20})
        health = await client.get("/health")
    assert keyed.status_code == 200 and "baton_router_requests_total" in keyed.text
    assert anonymous.status_code == (200 if public else 401)
    assert health.status_code == 200  # load balancers never need the key


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TWO_CALLS_CUT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_weather", "parameters": {"city": "Li'
)


@pytest.mark.parametrize("stream", [False, True])
async def test_required_parallel_calls_cut_at_max_tokens_keep_the_complete_ones(
    tokenizer: Tokenizer, stream: bool
) -> None:
    script = tokenizer.encode(TWO_CALLS_CUT, add_special_tokens=False)
    request = {
        **CHAT,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": len(script),  # the answer ends inside the second call
        "stream": stream,
    }
    async with cluster(tokenizer, [worker(script, tokens_per_chunk=3)]) as client:
        r = await client.post("/v1/chat/completions", json=request)
    assert r.status_code == 200, r.text
    if stream:
        chunks = events(r.text)[:-1]
        deltas = [c["choices"][0] for c in chunks]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        finish = deltas[-1]["finish_reason"]
    else:
        (choice,) = r.json()["choices"]
        content = choice["message"]["content"] or ""
        calls = choice["message"]["tool_calls"]
        finish = choice["finish_reason"]
    assert content == ""  # never the raw array
    (call,) = calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert finish == "length"


async def test_health_names_the_cluster(tokenizer: Tokenizer, script: list[int]) -> None:
    async with cluster(tokenizer, [worker(script)], cluster_id="c-0123") as client:
        assert (await client.get("/health")).json()["cluster_id"] == "c-0123"
    async with cluster(tokenizer, [worker(script)]) as client:
        assert len((await client.get("/health")).json()["cluster_id"]) == 8  # random
