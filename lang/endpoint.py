"""`RuntimeEndpoint`: a backend that speaks HTTP to baton's router (or any server with the
same endpoints: SGLang's `/generate`, vLLM's `/tokenize`, `/tokenizer_info`).

    generate        POST /generate {"text", "sampling_params", "stream"}; streamed answers
                    carry the text so far (SGLang's cumulative stream)
    choice scores   POST /tokenize for the prompt and each choice, POST /generate of the
                    prompt alone (computed once, then cached), then one POST /generate
                    per choice with `input_ids` = prompt + choice, `return_logprob` and
                    `logprob_start_len` = the prompt's length: the choice's token logprobs
    chat template   GET /tokenizer_info (the Jinja source and special tokens), once
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from baton.lang.backend import Backend, Generation
from baton.lang.chat_template import ChatTemplate
from baton.lang.errors import EndpointError

DEFAULT_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
# a prefill-only request: the smallest generation that still computes (and caches) a prompt
_PREFILL_ONLY = {"max_new_tokens": 1, "temperature": 0}


class RuntimeEndpoint(Backend):
    """The server at `base_url` (e.g. "http://127.0.0.1:8000"). `api_key` is sent as a
    bearer token. `chat_template` overrides the one derived from the model's template.
    `transport`: an httpx transport of your own (TLS client certificates, a mock)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        chat_template: ChatTemplate | None = None,
        max_parallel_requests: int = 32,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            transport=transport,
        )
        self._template = chat_template
        self._template_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_parallel_requests, thread_name_prefix="baton-lang")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> RuntimeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # -- Backend -----------------------------------------------------------------------------

    def generate(
        self,
        text: str,
        sampling: dict[str, Any],
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        body = {"text": text, "sampling_params": sampling}
        if on_text is None:
            answer = self._post("/generate", body)
            return Generation(answer["text"], answer.get("meta_info") or {})
        seen = ""
        meta: dict[str, Any] = {}
        for event in self._stream("/generate", {**body, "stream": True}):
            new = event["text"]
            if len(new) > len(seen):
                on_text(new[len(seen) :])
                seen = new
            meta = event.get("meta_info") or {}
        if meta.get("finish_reason") is None:
            raise EndpointError("POST /generate", "the stream ended before the answer did")
        return Generation(seen, meta)

    def choice_logprobs(self, text: str, choices: Sequence[str]) -> list[list[float]]:
        prompt = self.tokenize(text)
        if not prompt:
            raise ValueError("select needs text before it: a choice's first token has no logprob")
        ids = list(self._pool.map(lambda c: self.tokenize(c, add_special_tokens=False), choices))
        for choice, choice_ids in zip(choices, ids, strict=True):
            if not choice_ids:
                raise ValueError(f"choice {choice!r} has no tokens")
        self._post("/generate", {"input_ids": prompt, "sampling_params": _PREFILL_ONLY})
        return list(self._pool.map(lambda c: self._scored(prompt, c), ids))

    def cache_prefix(self, text: str) -> None:
        if text:
            self._post("/generate", {"text": text, "sampling_params": _PREFILL_ONLY})

    def chat_template(self) -> ChatTemplate:
        with self._template_lock:
            if self._template is None:
                self._template = self._served_template()
            return self._template

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The server's token ids for `text` (with its BOS, if it adds one, by default)."""
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        return list(self._post("/tokenize", body)["tokens"])

    def _scored(self, prompt: list[int], choice: list[int]) -> list[float]:
        answer = self._post(
            "/generate",
            {
                "input_ids": prompt + choice,
                "sampling_params": _PREFILL_ONLY,
                "return_logprob": True,
                "logprob_start_len": len(prompt),
            },
        )
        entries = (answer.get("meta_info") or {}).get("input_token_logprobs") or []
        if [e[1] for e in entries] != choice:
            raise EndpointError(
                "POST /generate",
                f"input_token_logprobs name tokens {[e[1] for e in entries]}, expected the "
                f"choice's {choice} (does the server honor logprob_start_len?)",
            )
        return [float(e[0]) for e in entries]

    def _served_template(self) -> ChatTemplate:
        info = self._get("/tokenizer_info")
        source = info.get("chat_template")
        if not isinstance(source, str) or not source:
            raise ValueError(
                "the served model has no chat template; role blocks need one (pass "
                "chat_template=ChatTemplate(...) to RuntimeEndpoint)"
            )
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        variables = {k: info[k] for k in names if isinstance(info.get(k), str)}
        template = ChatTemplate.from_jinja(source, variables)
        bos = variables.get("bos_token")
        if bos and self.tokenize(""):
            # The server's tokenizer starts every text with its BOS by itself.
            template = template.without_leading(bos)
        return template

    def _get(self, path: str) -> Any:
        return self._answer(f"GET {path}", lambda: self._client.get(path))

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._answer(f"POST {path}", lambda: self._client.post(path, json=body))

    def _answer(self, request: str, send: Callable[[], httpx.Response]) -> Any:
        try:
            response = send()
        except httpx.HTTPError as e:
            raise EndpointError(request, f"{self.base_url}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise _error(request, response)
        try:
            return response.json()
        except ValueError as e:
            raise EndpointError(request, f"not JSON: {response.text[:200]!r}", 200) from e

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON events of a server-sent event stream; an error event raises."""
        request = f"POST {path}"
        try:
            with self._client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise _error(request, response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise EndpointError.from_body(request, None, event, data)
                    yield event
        except httpx.HTTPError as e:
            raise EndpointError(request, f"{self.base_url}: {type(e).__name__}: {e}") from e


def _error(request: str, response: httpx.Response) -> EndpointError:
    try:
        body = response.json()
    except ValueError:
        body = None
    return EndpointError.from_body(request, response.status_code, body, response.text)
