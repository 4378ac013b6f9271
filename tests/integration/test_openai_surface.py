"""The OpenAI surface against `baton up` with the random-weight tiny model: structured
output, forced tools, logit_bias, lm-eval's loglikelihood request, LangChain, metrics."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from baton.common.models.tiny import default_model_path
from baton.common.tokenizer import Tokenizer
from tests.conftest import hf_prompt_logprobs
from tests.integration.cluster import Cluster, cluster

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "fresh": {"type": "boolean"},
    },
    "required": ["size", "count", "fresh"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What should I know?"}]


ADMIN = "admin-" + "secret"


@pytest.fixture(scope="module")
def agg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = {"BATON_ADMIN_API_KEY": ADMIN}
    with cluster(tmp_path_factory.mktemp("surface"), "--workers", "1", env=env) as c:
        yield c


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def valid(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"size", "count", "fresh"}
        and value["size"] in ("small", "large")
        and isinstance(value["count"], int)
        and 0 <= value["count"] <= 99
        and isinstance(value["fresh"], bool)
    )


def test_json_schema_validates_for_several_seeds(agg: Cluster) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    for seed in range(4):
        status, body = agg.post(
            "/v1/chat/completions",
            {
                "model": agg.model_name,
                "messages": USER,
                "temperature": 1.0,
                "seed": seed,
                "max_tokens": 64,
                "response_format": fmt,
            },
        )
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert valid(json.loads(choice["message"]["content"])), choice


def test_regex_and_choice_match_in_full(agg: Cluster) -> None:
    pattern = r"[a-f]{3}-[0-9]{2}"
    status, body = agg.post(
        "/v1/completions",
        {"model": agg.model_name, "prompt": "Code:", "regex": pattern, "max_tokens": 16, "seed": 3},
    )
    assert status == 200, body
    assert re.fullmatch(pattern, body["choices"][0]["text"]), body
    status, body = agg.post(
        "/generate",
        {
            "text": "Pick:",
            "sampling_params": {"max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"'},
        },
    )
    assert status == 200 and body["text"] in ("yes", "no"), body


def test_forced_tool_choices_parse(agg: Cluster) -> None:
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        status, body = agg.post(
            "/v1/chat/completions",
            {
                "model": agg.model_name,
                "messages": USER,
                "tools": [WEATHER],
                "tool_choice": choice,
                "parallel_tool_calls": False,  # one call: a weak model never ends a list
                "temperature": 1.0,
                "seed": 5,
                "max_tokens": 96,
            },
        )
        assert status == 200, body
        message = body["choices"][0]["message"]
        assert "tool_calls" in message, body
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        arguments = json.loads(call["function"]["arguments"])
        assert arguments["city"] in ("Paris", "Lima") and 1 <= arguments["days"] <= 7
        reason = "stop" if isinstance(choice, dict) else "tool_calls"
        assert body["choices"][0]["finish_reason"] == reason


def test_logit_bias_makes_greedy_repeat_a_token(agg: Cluster, tok: Tokenizer) -> None:
    token = tok.encode(" cat", add_special_tokens=False)[0]
    status, body = agg.post(
        "/v1/completions",
        {
            "model": agg.model_name,
            "prompt": "Hello",
            "temperature": 0,
            "max_tokens": 6,
            "logit_bias": {str(token): 100},
        },
    )
    assert status == 200, body
    assert body["choices"][0]["text"] == tok.decode([token]) * 6


def test_lm_eval_loglikelihood_request_equals_transformers(agg: Cluster, tok: Tokenizer) -> None:
    """The body lm-eval's local-completions sends for loglikelihood (token ids, echo)."""
    context = tok.encode("The cat sat on the", add_special_tokens=False)
    continuation = tok.encode(" mat.", add_special_tokens=False)
    prompt = context + continuation
    status, body = agg.post(
        "/v1/completions",
        {
            "model": agg.model_name,
            "prompt": [prompt],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    )
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
    want = hf_prompt_logprobs(default_model_path(), prompt)
    got = lp["token_logprobs"][1 : len(prompt)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    # what lm-eval reads: the continuation's logprobs and whether each was the argmax
    ctxlen = len(context)
    continuation_lps = lp["token_logprobs"][ctxlen:-1]
    for token_lp, top in zip(continuation_lps, lp["top_logprobs"][ctxlen:-1], strict=True):
        assert len(top) == 1 and max(top.values()) >= token_lp - 1e-6
    assert math.isfinite(sum(lp["token_logprobs"][ctxlen:-1]))


def test_vllm_prompt_logprobs_on_chat(agg: Cluster, tok: Tokenizer) -> None:
    status, body = agg.post(
        "/v1/chat/completions",
        {"model": agg.model_name, "messages": USER, "max_tokens": 1, "prompt_logprobs": 1},
    )
    assert status == 200, body
    prompt = tok.apply_chat_template(USER)
    entries = body["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    want = hf_prompt_logprobs(default_model_path(), prompt)
    for token, entry, logprob in zip(prompt[1:], entries[1:], want, strict=True):
        assert abs(entry[str(token)]["logprob"] - logprob) < 1e-3
        assert any(e["rank"] == 1 for e in entry.values())


def test_flush_cache_empties_the_workers_prefix_cache(agg: Cluster) -> None:
    agg.post(
        "/v1/completions", {"model": agg.model_name, "prompt": "flush me " * 20, "max_tokens": 2}
    )
    (worker,) = agg.workers()
    assert agg.wait_idle()[0].pages_cached > 0
    status, _ = agg.post("/flush_cache", {}, headers={"authorization": "Bearer wrong"})
    assert status == 401
    status, body = agg.post("/flush_cache", {}, headers={"authorization": f"Bearer {ADMIN}"})
    assert status == 200 and body == {"flushed": True, "workers": 1}
    time.sleep(0.6)  # workers publish their statistics every 0.25 s
    assert agg.worker_stats(worker.grpc_address).pages_cached == 0


def test_langchain_structured_output_and_tools(agg: Cluster) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        size: Literal["small", "large"]
        count: int = Field(ge=0, le=99)
        fresh: bool

    llm = ChatOpenAI(
        base_url=agg.url + "/v1",
        api_key="none",  # type: ignore[arg-type]
        model=agg.model_name,
        temperature=1.0,
        max_tokens=64,  # type: ignore[call-arg]
        seed=7,
        max_retries=0,
    )
    item = llm.with_structured_output(Item, method="json_schema").invoke("Describe one item")
    assert isinstance(item, Item)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("Weather?")
    (call,) = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Lima")


def test_one_scrape_sees_the_cluster(agg: Cluster) -> None:
    agg.post("/v1/completions", {"model": agg.model_name, "prompt": "x", "max_tokens": 3})
    with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "baton_router_time_per_output_token_seconds_count" in text
    assert re.search(r'baton_worker_prefix_cache_queries_total\{.*role="both".*\} \d', text)
    assert "baton_worker_role_stat" not in text
