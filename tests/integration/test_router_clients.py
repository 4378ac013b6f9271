"""What clients nobody on the project wrote send and expect (issue #42): guidellm's stream
options, line splitters that know Unicode, lower-case bearer schemes, scrapers without a key.

The router runs in-process against fake gRPC workers (`router_api`).
"""

from __future__ import annotations

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
    async with cluster(tokenizer, [worker(script)]) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
        )
    assert r.status_code == 200, r.text
    *chunks, _ = events(r.text)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3]
    # without include_usage, no closing chunk: the last one finished the choice
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


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
