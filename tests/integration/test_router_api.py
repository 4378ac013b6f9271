"""The router's public API against fake gRPC workers (aggregated mode).

The router app runs in-process behind httpx's ASGI transport; the workers are real
grpc.aio servers on loopback that "generate" a fixed script of real token ids, so text,
stop strings and usage can be checked exactly.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from baton.common.models.tiny import default_model_path
from baton.common.tokenizer import Tokenizer
from tests.integration.router_api import (
    CHAT,
    COMPLETION,
    MODEL,
    TEXT,
    cluster,
    events,
    eventually,
    worker,
)

pytestmark = pytest.mark.timeout(30)


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
        "ingress",
        "prefill_queue",
        "prefill_compute",
        "first_token_delivery",
        "first_text_wait",
        "kv_transfer",
        "decode_admission",
        "placement",
        "placement_reason",
        "predicted_ttft",
        "handed_back_by",
    }
    assert timings["placement"] == timings["placement_reason"] == ""  # aggregated: not placed
    assert timings["handed_back_by"] == ""
    assert timings["predicted_ttft"] == 0.0
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


async def test_first_text_wait_when_the_first_token_is_part_of_a_character(
    tokenizer: Tokenizer,
) -> None:
    """A first token that ends inside a character gives a client no content until the
    tokens that complete it: `baton_timings` says how long the router held it back."""
    script = tokenizer.encode("🐈 cat", add_special_tokens=False)  # 3 tokens to the 🐈
    fake = worker(script, delay=0.1)
    async with cluster(tokenizer, [fake]) as client:
        body = {**COMPLETION, "max_tokens": len(script), "stream": True}
        r = await client.post("/v1/completions", json=body)
    chunks = [c for c in events(r.text) if c != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert next(t for t in texts if t) == "🐈"
    timings = chunks[-1]["baton_timings"]
    assert 0.15 < timings["first_text_wait"] < 1.0  # two tokens 0.1 s apart
