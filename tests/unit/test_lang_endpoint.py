"""RuntimeEndpoint over HTTP, against a mock server: the requests it sends, the answers it
reads (plain and streamed), and errors that carry the server's message."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from baton.lang import EndpointError, RuntimeEndpoint
from baton.lang.chat_template import ChatTemplate

Handler = Callable[[str, dict[str, Any]], httpx.Response]


def endpoint(handler: Handler, api_key: str | None = None) -> tuple[RuntimeEndpoint, list[Any]]:
    """An endpoint whose requests go to `handler(path, body)`; the list records them."""
    seen: list[Any] = []

    def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append((request.url.path, body, request.headers.get("authorization")))
        return handler(request.url.path, body)

    return RuntimeEndpoint("http://server", api_key, transport=httpx.MockTransport(respond)), seen


def sse(*events: Any) -> httpx.Response:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def test_generate_sends_text_and_sampling_and_the_api_key() -> None:
    answer = {"text": "Paris", "meta_info": {"cached_tokens": 4, "finish_reason": {"type": "stop"}}}
    ep, seen = endpoint(lambda path, body: httpx.Response(200, json=answer), api_key="sk-1")
    result = ep.generate("Capital: ", {"max_new_tokens": 4, "temperature": 0})
    assert (result.text, result.meta_info["cached_tokens"]) == ("Paris", 4)
    assert seen == [
        (
            "/generate",
            {"text": "Capital: ", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            "Bearer sk-1",
        )
    ]


def test_an_error_answer_carries_the_servers_message() -> None:
    error = {
        "error": {
            "message": "sampling_params.regex: unbalanced parenthesis",
            "type": "invalid_request_error",
            "param": "sampling_params.regex",
            "code": None,
        }
    }
    ep, _ = endpoint(lambda path, body: httpx.Response(400, json=error))
    with pytest.raises(EndpointError) as info:
        ep.generate("x", {"regex": "("})
    e = info.value
    assert (e.status, e.param, e.message) == (
        400,
        "sampling_params.regex",
        "sampling_params.regex: unbalanced parenthesis",
    )
    assert str(e) == (
        "POST /generate: 400 invalid_request_error (param sampling_params.regex): "
        "sampling_params.regex: unbalanced parenthesis"
    )


def test_a_non_json_error_is_quoted() -> None:
    ep, _ = endpoint(lambda path, body: httpx.Response(502, text="<html>Bad Gateway</html>"))
    with pytest.raises(EndpointError, match="502 error: <html>Bad Gateway</html>"):
        ep.generate("x", {})


def test_no_answer_says_so() -> None:
    def refuse(path: str, body: dict[str, Any]) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    ep, _ = endpoint(refuse)
    with pytest.raises(EndpointError, match="no answer: http://server: ConnectError") as info:
        ep.generate("x", {})
    assert info.value.status is None


def test_a_stream_delivers_new_text_in_order() -> None:
    events = [
        {"text": "one", "meta_info": {"finish_reason": None}},
        {"text": "one two", "meta_info": {"finish_reason": None}},
        {"text": "one two three", "meta_info": {"finish_reason": {"type": "length"}}},
    ]
    ep, seen = endpoint(lambda path, body: sse(*events))
    pieces: list[str] = []
    result = ep.generate("x", {}, pieces.append)
    assert pieces == ["one", " two", " three"]
    assert result.text == "one two three"
    assert result.meta_info["finish_reason"] == {"type": "length"}
    assert seen[0][1]["stream"] is True


def test_an_error_inside_a_stream_raises_with_its_message() -> None:
    events = [
        {"text": "one", "meta_info": {"finish_reason": None}},
        {"error": {"message": "decode worker lost", "type": "server_error"}},
    ]
    ep, _ = endpoint(lambda path, body: sse(*events))
    pieces: list[str] = []
    with pytest.raises(EndpointError, match="server_error: decode worker lost"):
        ep.generate("x", {}, pieces.append)
    assert pieces == ["one"]


def test_a_stream_cut_short_is_an_error() -> None:
    ep, _ = endpoint(
        lambda path, body: httpx.Response(
            200, text='data: {"text": "on", "meta_info": {"finish_reason": null}}\n\n'
        )
    )
    with pytest.raises(EndpointError, match="ended before the answer"):
        ep.generate("x", {}, lambda piece: None)


def test_choice_logprobs_prefill_the_prompt_once_then_score_each_choice() -> None:
    vocab = {"Q:": [1, 2], " yes": [7], " no way": [8, 9]}
    logprob = {7: -0.5, 8: -2.0, 9: -0.25}

    def handle(path: str, body: dict[str, Any]) -> httpx.Response:
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": vocab[body["prompt"]]})
        ids = body["input_ids"]
        meta: dict[str, Any] = {"finish_reason": {"type": "length"}}
        if body.get("return_logprob"):
            start = body["logprob_start_len"]
            meta["input_token_logprobs"] = [[logprob[t], t, None] for t in ids[start:]]
        return httpx.Response(200, json={"text": "", "meta_info": meta})

    ep, seen = endpoint(handle)
    assert ep.choice_logprobs("Q:", [" yes", " no way"]) == [[-0.5], [-2.0, -0.25]]
    generates = [body for path, body, _ in seen if path == "/generate"]
    assert generates[0] == {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    scored = sorted(generates[1:], key=lambda b: b["input_ids"])
    assert [(b["input_ids"], b["logprob_start_len"]) for b in scored] == [
        ([1, 2, 7], 2),
        ([1, 2, 8, 9], 2),
    ]
    tokenized = {
        body["prompt"]: body["add_special_tokens"] for p, body, _ in seen if p == "/tokenize"
    }
    assert tokenized == {"Q:": True, " yes": False, " no way": False}


def test_logprobs_for_other_tokens_are_refused() -> None:
    def handle(path: str, body: dict[str, Any]) -> httpx.Response:
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1] if body["prompt"] == "Q" else [5]})
        meta = {"input_token_logprobs": [[-1.0, 1, None], [-1.0, 5, None]]}  # ignored the start
        return httpx.Response(200, json={"text": "", "meta_info": meta})

    ep, _ = endpoint(handle)
    with pytest.raises(EndpointError, match="logprob_start_len"):
        ep.choice_logprobs("Q", ["a"])


def test_the_chat_template_comes_from_the_server_without_a_second_bos() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    info = {"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"}

    def handle(path: str, body: dict[str, Any]) -> httpx.Response:
        if path == "/tokenizer_info":
            return httpx.Response(200, json=info)
        return httpx.Response(200, json={"tokens": [0]})  # the server adds a BOS by itself

    ep, _ = endpoint(handle)
    template = ep.chat_template()
    assert template == ChatTemplate(
        prefix={"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"},
        suffix={"system": "<|end|>", "user": "<|end|>", "assistant": "<|end|>"},
        start={"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"},
    )


def test_a_model_without_a_chat_template_is_refused_clearly() -> None:
    ep, _ = endpoint(lambda path, body: httpx.Response(200, json={"chat_template": None}))
    with pytest.raises(ValueError, match="no chat template"):
        ep.chat_template()
