"""The router's public API against fake gRPC workers (aggregated mode).

The router app runs in-process behind httpx's ASGI transport; the workers are real
grpc.aio servers on loopback that "generate" a fixed script of real token ids, so text,
stop strings and usage can be checked exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.common.models.tiny import default_model_path
from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.router.app import create_app
from baton.services.router.config import RouterConfig
from tests.integration.fake_worker import FakeBehavior, FakeWorker

pytestmark = pytest.mark.timeout(30)

MODEL = "tiny-llama-v1"
TEXT = "Hello world, the cat sat on the mat."
TIMINGS = pb.Timings(queue=0.25, prefill=0.5, kv_transfer=0.0, decode_admission=0.0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def script(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


@asynccontextmanager
async def cluster(
    tokenizer: Tokenizer, workers: list[FakeWorker], **config: Any
) -> AsyncIterator[httpx.AsyncClient]:
    for worker in workers:
        await worker.start()
    app = create_app(RouterConfig(**config), [w.info() for w in workers], tokenizer=tokenizer)
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


async def eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


# -- generation ---------------------------------------------------------------------------


async def test_completion_text_usage_and_timings(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Say it", "max_tokens": 5}
        )
        await asyncio.sleep(0.1)
    assert fake.aborted == [] and fake.unfinished == []  # it finished: nothing to abort
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(script[:5]) == "Hello world, the c"
    assert choice["finish_reason"] == "length"
    prompt_len = len(tokenizer.encode("Say it"))
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 5,
        "total_tokens": prompt_len + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    timings = body["baton_timings"]
    assert set(timings) == {
        "router_queue",
        "prefill_queue",
        "prefill_compute",
        "kv_transfer",
        "decode_admission",
    }
    assert timings["prefill_queue"] == 0.25 and timings["prefill_compute"] == 0.5
    assert 0 <= timings["router_queue"] < 5


async def test_chat_stream_role_content_usage_done(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script, tokens_per_chunk=2)
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 100,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    first, *middle, last, _ = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in middle)
    assert text == tokenizer.decode([script[i % len(script)] for i in range(100)])
    assert middle[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in middle)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 100
    assert last["baton_timings"]["prefill_compute"] == 0.5
    # The chat template wrapped the message: the worker saw more than the bare text.
    prompt = list(fake.requests[0].input_ids)
    assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_split_across_chunks_is_cut_and_aborts(
    tokenizer: Tokenizer, script: list[int], stream: bool
) -> None:
    # " c" "at" " s" "at" arrive one token per chunk: "cat sat" spans four of them.
    fake = worker(script, delay=0.01)
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "stop": ["cat sat", "zzz"], "stream": stream},
        )
        chunks = events(r.text) if stream else None
        text = (
            "".join(c["choices"][0]["text"] for c in chunks[:-1])
            if chunks
            else r.json()["choices"][0]["text"]
        )
        finish = (chunks[-2] if chunks else r.json())["choices"][0]["finish_reason"]
        assert text == "Hello world, the " and finish == "stop"
        # The worker was still generating: the router aborted it.
        await eventually(lambda: fake.aborted == [fake.requests[0].request_id])


async def test_eos_ends_with_stop_and_ignore_eos_does_not(tokenizer: Tokenizer) -> None:
    eos = min(tokenizer.eos_token_ids)
    script = [*tokenizer.encode("Hi there", add_special_tokens=False), eos]
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        (choice,) = r.json()["choices"]
        assert choice == {**choice, "text": "Hi there", "finish_reason": "stop"}
        assert set(tokenizer.eos_token_ids) <= set(fake.requests[0].sampling.stop_token_ids)
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 7, "ignore_eos": True},
        )
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert list(fake.requests[1].sampling.stop_token_ids) == []


async def test_default_max_tokens_fills_the_context(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post("/generate", json={"input_ids": [5, 6, 7], "stream": False})
        assert r.status_code == 200
    context = json.loads((default_model_path() / "config.json").read_text())[
        "max_position_embeddings"
    ]
    assert fake.requests[0].sampling.max_new_tokens == context - 3


async def test_n_choices_with_seeds(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "n": 3, "seed": 7}
        r = await client.post("/v1/completions", json=body)
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert all(c["text"] == "Hello world," for c in choices)
        assert sorted(q.sampling.seed for q in fake.requests) == [7, 8, 9]
        assert r.json()["usage"]["completion_tokens"] == 9
        r = await client.post("/v1/completions", json={**body, "stream": True, "n": 2})
        finished = [
            c["choices"][0]["index"]
            for c in events(r.text)[:-1]
            if c["choices"][0]["finish_reason"]
        ]
        assert sorted(finished) == [0, 1]


async def test_logprobs_shapes(tokenizer: Tokenizer, script: list[int]) -> None:
    async with cluster(tokenizer, [worker(script)]) as client:
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 4, "logprobs": 2},
        )
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == ["Hello", " world", ",", " the"]
        assert lp["token_logprobs"] == [-0.5] * 4
        assert [len(t) for t in lp["top_logprobs"]] == [2] * 4
        assert lp["text_offset"] == [0, 5, 11, 12]
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 3,
            },
        )
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == ["Hello", " world", ","]
        assert all(len(c["top_logprobs"]) == 3 for c in content)
        assert content[0]["bytes"] == list(b"Hello")
        r = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        )
        assert r.json()["choices"][0]["logprobs"] is None


async def test_sglang_generate(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "top_k": 5}},
        )
        body = r.json()
        assert body["output_ids"] == script[:3] and body["text"] == "Hello world,"
        meta = body["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
        r = await client.post(
            "/generate",
            json={
                "text": "Hi",
                "sampling_params": {"max_new_tokens": 2, "sampling_seed": 4, "stop": "zz"},
                "stream": True,
                "return_logprob": True,
                "top_logprobs_num": 1,
            },
        )
        chunks = events(r.text)
        assert chunks[-1] == "[DONE]"
        # SGLang's stream is cumulative: each event holds the text so far.
        assert [c["text"] for c in chunks[:-1]] == ["Hello", "Hello world"]
        assert chunks[-2]["output_ids"] == script[:2]
        assert chunks[-2]["meta_info"]["output_token_logprobs"][1] == [-0.5, script[1], None]
        assert list(fake.requests[1].input_ids) == tokenizer.encode("Hi")
        assert fake.requests[1].sampling.seed == 4


async def test_openai_client(tokenizer: Tokenizer, script: list[int]) -> None:
    async with cluster(tokenizer, [worker(script)], api_key="sk-test") as http:
        client = openai.AsyncOpenAI(
            base_url="http://router/v1",
            api_key="sk-test",
            http_client=http,  # type: ignore[arg-type]  # openai accepts httpx clients too
            max_retries=0,
        )
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert completion.choices[0].message.content == "Hello world, the"
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        stream = await client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=6, stream=True, stop=" sat"
        )
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert "".join(pieces) == "Hello world, the cat"
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="gpt-4", prompt="x")


# -- errors --------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": MODEL, "prompt": "x"}


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
        ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 2.0}}, 400, "top_p", None),
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
        assert (await client.get("/metrics")).status_code == 200


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
        for _ in range(250):  # until the second request waits in line
            if "baton_router_requests_queued 1.0" in (await client.get("/metrics")).text:
                break
            await asyncio.sleep(0.02)
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


# -- utility endpoints ----------------------------------------------------------------------


async def test_tokenize_detokenize_version_and_model_cards(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    async with cluster(tokenizer, [worker(script)]) as client:
        r = await client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})
        body = r.json()
        assert body["tokens"] == tokenizer.encode(TEXT) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
        chat = [{"role": "user", "content": "Hi"}]
        r = await client.post("/tokenize", json={"model": MODEL, "messages": chat})
        assert r.json()["tokens"] == tokenizer.apply_chat_template(chat)
        r = await client.post("/tokenize", json={"prompt": "x", "messages": chat})
        assert r.status_code == 400
        r = await client.post("/detokenize", json={"tokens": script})
        assert r.json() == {"prompt": TEXT}
        assert (await client.post("/detokenize", json={"tokens": [10**6]})).status_code == 400
        info = (await client.get("/tokenizer_info")).json()
        assert info["eos_token"] and "im_start" in info["chat_template"]
        assert (await client.get("/version")).json()["version"]
        card = (await client.get(f"/v1/models/{MODEL}")).json()
        assert card["id"] == MODEL and card["parent"] is None
        assert card["root"] == str(default_model_path())
        assert (await client.get("/v1/models")).json()["data"] == [card]
        assert (await client.get("/v1/models/gpt-4")).status_code == 404


async def test_flush_cache_needs_the_admin_key(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script)
    async with cluster(tokenizer, [fake]) as client:
        assert (await client.post("/flush_cache")).status_code == 403  # no admin key: off
    async with cluster(tokenizer, [fake], admin_api_key="adm") as client:
        assert (await client.post("/flush_cache")).status_code == 401
        r = await client.post("/flush_cache", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json() == {"flushed": True, "workers": 1}
        assert fake.flushes == 1
        fake.behavior.busy = True
        r = await client.post("/flush_cache", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 400 and "requests are running" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_tool_calls_are_read_from_the_text(tokenizer: Tokenizer, stream: bool) -> None:
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    eos = min(tokenizer.eos_token_ids)
    fake = worker([*tokenizer.encode(text, add_special_tokens=False), eos])
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    async with cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/v1/chat/completions", json={**CHAT, "tools": [tool], "stream": stream}
        )
    assert r.status_code == 200, r.text
    if stream:
        chunks = [c for c in events(r.text)[:-1] if c["choices"]]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        message = r.json()["choices"][0]["message"]
        content, calls = message["content"], message["tool_calls"]
        finish = r.json()["choices"][0]["finish_reason"]
    assert content == "Checking." and finish == "tool_calls"
    (call,) = calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert not fake.requests[0].sampling.HasField("grammar")  # auto constrains nothing


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
