"""One streamed request against an OpenAI-compatible server, timed on the client's clock.

This module only talks HTTP and notes when things happened (`time.perf_counter()`);
turning those instants into TTFT, ITL and friends is `metrics`' job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import msgspec

from baton.benchmarks.datasets import BenchRequest

# A body larger than this is not an OpenAI response; stop reading it.
MAX_ERROR_BODY_BYTES = 2048


@dataclass
class Measurement:
    """What one request saw. Instants are `time.perf_counter()` values."""

    ok: bool = False
    error: str | None = None
    content_times: list[float] = field(default_factory=list)  # one per chunk with content
    # when a chunk carried the finish: an answer whose tokens all read as no text (a special
    # token, bytes short of a character) has no content chunk, yet was served
    finish_time: float | None = None
    end_time: float = 0.0
    prompt_tokens: int | None = None  # from the server's usage, when sent
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    completion_tokens: int | None = None  # from the server's usage, when sent
    server_timings: dict[str, float] | None = None  # `baton_timings`, when sent
    placement: str | None = None  # `baton_timings.placement`: where baton prefilled it
    placement_reason: str | None = None  # `baton_timings.placement_reason`: why (its costs)
    handed_back_by: str | None = None  # `baton_timings.handed_back_by`: a D that handed it back


@dataclass(frozen=True)
class ChunkInfo:
    """The parts of one response object (an SSE chunk or a whole body) the benchmark reads."""

    content: str = ""
    usage: dict[str, Any] | None = None
    timings: dict[str, float] | None = None
    placement: str | None = None
    placement_reason: str | None = None
    handed_back_by: str | None = None
    error: str | None = None
    finished: bool = False  # the first choice carried a finish_reason


def build_payload(
    request: BenchRequest,
    endpoint: str,
    model: str,
    sampling: dict[str, float | int] | None = None,
) -> dict[str, Any]:
    """The JSON body for `request` on `endpoint` ("completions" or "chat"), with
    `sampling` (temperature, top_p, ...) as given. A built prompt goes to the completions
    API as token ids, where it has them: tokens the server does not re-tokenize."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),
    }
    if request.ignore_eos:
        body["ignore_eos"] = True
    prompt = request.prompt
    if endpoint == "chat":
        text = prompt if isinstance(prompt, str) else prompt.text()
        messages = [{"role": "user", "content": text}]
        if request.system is not None:
            messages.insert(0, {"role": "system", "content": request.system})
        body["messages"] = messages
    elif isinstance(prompt, str):
        prefix = "" if request.system is None else request.system + "\n\n"
        body["prompt"] = prefix + prompt
    else:
        ids = prompt.token_ids()
        body["prompt"] = ids if ids is not None else prompt.text()
    return body


def parse_response_object(obj: Any) -> ChunkInfo:
    """Content text, usage, `baton_timings` and error of a completion or chat object.

    Works for streamed chunks (`text`, `delta`) and whole bodies (`message`) alike.
    """
    if not isinstance(obj, dict):
        return ChunkInfo(error=f"unexpected response object: {str(obj)[:200]}")
    if obj.get("error") is not None:
        return ChunkInfo(error=f"server error: {str(obj['error'])[:500]}")
    content = ""
    finished = False
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        finished = isinstance(choice.get("finish_reason"), str)
        for holder in (choice, choice.get("delta"), choice.get("message")):
            if isinstance(holder, dict):
                for key in ("text", "content", "reasoning_content"):
                    value = holder.get(key)
                    if isinstance(value, str):
                        content += value
    usage = obj.get("usage")
    timings = obj.get("baton_timings")
    placement = timings.get("placement") if isinstance(timings, dict) else None
    reason = timings.get("placement_reason") if isinstance(timings, dict) else None
    handed_back = timings.get("handed_back_by") if isinstance(timings, dict) else None
    return ChunkInfo(
        content=content,
        usage=usage if isinstance(usage, dict) else None,
        timings=_numeric_fields(timings),
        # "" from an aggregated worker, which prefills what it decodes
        placement=(placement or "aggregated") if isinstance(placement, str) else None,
        placement_reason=reason if isinstance(reason, str) and reason else None,
        handed_back_by=handed_back if isinstance(handed_back, str) and handed_back else None,
        finished=finished,
    )


async def fetch_model_card(
    client: httpx.AsyncClient, base_url: str, model: str | None = None
) -> dict[str, Any]:
    """The card of `model` (None: the first) served at `base_url` (GET /v1/models)."""
    response = await client.get(base_url.rstrip("/") + "/v1/models")
    response.raise_for_status()
    cards = [c for c in response.json().get("data") or [] if isinstance(c, dict) and c.get("id")]
    if model is not None:
        cards = [c for c in cards if c["id"] == model] or [{"id": model}]
    if not cards:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return cards[0]


def open_session(headers: dict[str, str], timeout_s: float) -> aiohttp.ClientSession:
    """The session the timed requests go through: aiohttp, whose C parser took 2.3 ms of
    the client's CPU a request of 32 streamed chunks where httpx took 7.9 (80 req/s against
    `fake_server` on one machine; httpx's client then launched requests up to 60 ms late,
    and on a GPU host at 56-72 req/s up to 0.42 s). No connection limit: a request must
    never queue inside the client behind slow ones. `timeout_s` bounds the connect and
    each read; `serve` bounds the whole."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        headers=headers,
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=min(30.0, timeout_s), sock_read=timeout_s
        ),
    )


async def send(session: aiohttp.ClientSession, url: str, body: bytes) -> Measurement:
    """POST `body` and read the answer to its end, noting when each content chunk arrived.

    Never raises for a request that fails: the failure is the measurement.
    """
    m = Measurement()
    try:
        async with session.post(url, data=body) as response:
            if response.status != 200:
                text = await _read_capped(response)
                m.error = f"HTTP {response.status}: {text}"
            elif "text/event-stream" in response.headers.get("content-type", ""):
                await _read_events(response, m)
            else:
                _note(m, parse_response_object(msgspec.json.decode(await response.read())))
    except Exception as e:  # one request's failure, whatever it is, must not end the run
        m.error = f"{type(e).__name__}: {e}"[:500]
    m.end_time = time.perf_counter()
    if m.error is None and not m.content_times:
        if m.finish_time is not None and m.completion_tokens:
            # tokens were generated, they read as no text: the finish is the first answer
            m.content_times.append(m.finish_time)
        else:
            m.error = "response ended without any content"
    m.ok = m.error is None
    return m


async def _read_events(response: aiohttp.ClientResponse, m: Measurement) -> None:
    """Server-sent events, split into lines here (aiohttp's own line reader refuses a line
    past its buffer: a long final chunk is still one event)."""
    rest = b""
    async for data in response.content.iter_any():
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            if _event(line, m):
                return
    _event(rest, m)


def _event(line: bytes, m: Measurement) -> bool:
    """One line of the stream noted; True once the stream is over (`[DONE]`, an error)."""
    if not line.startswith(b"data:"):
        return False  # blank separators, comments, `event:` lines
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    _note(m, parse_response_object(msgspec.json.decode(data)))
    return m.error is not None


def _note(m: Measurement, info: ChunkInfo) -> None:
    now = time.perf_counter()
    if info.error is not None:
        m.error = info.error
        return
    if info.content:
        m.content_times.append(now)
    if info.finished and m.finish_time is None:
        m.finish_time = now
    if info.usage is not None:
        m.prompt_tokens = _count(info.usage.get("prompt_tokens"), m.prompt_tokens)
        m.completion_tokens = _count(info.usage.get("completion_tokens"), m.completion_tokens)
        details = info.usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            m.cached_tokens = _count(details.get("cached_tokens"), m.cached_tokens)
    if info.timings is not None:
        m.server_timings = info.timings
    if info.placement is not None:
        m.placement = info.placement
    if info.placement_reason is not None:
        m.placement_reason = info.placement_reason
    if info.handed_back_by is not None:
        m.handed_back_by = info.handed_back_by


async def _read_capped(response: aiohttp.ClientResponse) -> str:
    chunks = bytearray()
    async for chunk in response.content.iter_any():
        chunks.extend(chunk)
        if len(chunks) >= MAX_ERROR_BODY_BYTES:
            break
    return chunks[:MAX_ERROR_BODY_BYTES].decode("utf-8", errors="replace").strip()


def _count(value: object, previous: int | None) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return previous


def _numeric_fields(value: object) -> dict[str, float] | None:
    """A `baton_timings` object's finite numeric fields; None when there are none."""
    if not isinstance(value, dict):
        return None
    fields = {
        str(k): float(v)
        for k, v in value.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    return fields or None
