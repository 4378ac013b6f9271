"""A fake OpenAI-compatible streaming server, to test the benchmark without a model.

    python -m baton.benchmarks.fake_server --port 8000 --first-token-delay 0.2

It answers /v1/completions and /v1/chat/completions with `max_tokens` tokens of
"tok", `--tokens-per-chunk` to a chunk, after `--first-token-delay` and then one chunk
every `--chunk-delay` seconds; the final chunk carries `usage` (when asked for) and a
made-up `baton_timings`, like baton's router. A prompt is words, or token ids; the usage
counts them, and as `cached_tokens` the ones a prefix cache of 16-token pages that keeps
everything would have held (so that a benchmark's hit ratio can be checked). /health
and /v1/models are there too;
with `--workers N` its /health counts N aggregated workers as the router's does (and
`--expect-workers M`, `--lose-worker-after S` make that cluster partial), so a benchmark's
handling of a cluster short of workers can be tried without one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MAX_TOKENS_LIMIT = 100_000
CACHE_PAGE_TOKENS = 16


@dataclass(frozen=True)
class FakeServerConfig:
    model: str = "fake-model"
    first_token_delay_s: float = 0.05
    chunk_delay_s: float = 0.01
    tokens_per_chunk: int = 1
    default_max_tokens: int = 16
    timings: bool = True  # send `baton_timings` in the last chunk / body
    workers: int | None = None  # aggregated workers /health counts; None: no counts
    expect_workers: int | None = None  # workers /health says it expects
    lose_worker_after_s: float | None = None  # one worker leaves this long after the
    # first request (so that a run, not the start-up, sees it go)


class PrefixCache:
    """Every full page of every prompt seen, keyed by its chained hash: never evicts."""

    def __init__(self) -> None:
        self.pages: set[int] = set()

    def admit(self, tokens: Sequence[object]) -> int:
        """Tokens of `tokens`' longest cached prefix; then caches all its full pages."""
        chain, cached, hitting = 0, 0, True
        for start in range(0, len(tokens) - CACHE_PAGE_TOKENS + 1, CACHE_PAGE_TOKENS):
            chain = hash((chain, tuple(tokens[start : start + CACHE_PAGE_TOKENS])))
            hitting = hitting and chain in self.pages
            cached += CACHE_PAGE_TOKENS if hitting else 0
            self.pages.add(chain)
        return cached


def make_app(config: FakeServerConfig) -> FastAPI:
    app = FastAPI()
    first_request: list[float] = []  # when the first completion request arrived
    cache = PrefixCache()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if config.workers is None:
            return {"status": "ok"}
        joined = config.workers
        lose_after = config.lose_worker_after_s
        served_s = time.monotonic() - first_request[0] if first_request else 0.0
        if lose_after is not None and first_request and served_s >= lose_after:
            joined = max(0, joined - 1)
        expected = config.expect_workers
        partial = expected is not None and joined < expected
        return {
            "status": "partial" if partial else "ok",
            "workers": {"both": joined, "prefill": 0, "decode": 0},
            "expected": None if expected is None else {"both": expected, "prefill": 0, "decode": 0},
            "worker_ids": [f"worker-{i}" for i in range(joined)],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        first_request[:] = first_request or [time.monotonic()]
        return await _answer(config, cache, await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        first_request[:] = first_request or [time.monotonic()]
        return await _answer(config, cache, await request.json(), chat=True)

    return app


async def _answer(
    config: FakeServerConfig, cache: PrefixCache, body: dict[str, Any], *, chat: bool
) -> Any:
    max_tokens = body.get("max_tokens") or config.default_max_tokens
    if not isinstance(max_tokens, int) or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        return JSONResponse({"error": {"message": "bad max_tokens"}}, status_code=400)
    prompt = body.get("prompt", "")
    tokens: Sequence[object]
    if chat:
        tokens = " ".join(str(m.get("content", "")) for m in body.get("messages", [])).split()
    elif isinstance(prompt, list):
        tokens = prompt  # token ids
    else:
        tokens = str(prompt).split()
    usage = {
        "prompt_tokens": len(tokens),
        "completion_tokens": max_tokens,
        "total_tokens": len(tokens) + max_tokens,
        "prompt_tokens_details": {"cached_tokens": cache.admit(tokens)},
    }
    timings = {
        "router_queue": 0.001,
        "ingress": 0.0002,
        "prefill_queue": 0.002,
        "prefill_compute": config.first_token_delay_s,
        "first_token_delivery": 0.0003,
        "first_text_wait": 0.0,
        "kv_transfer": 0.003,
        "decode_admission": 0.0005,
    }
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": config.model}
    if not body.get("stream"):
        await asyncio.sleep(config.first_token_delay_s)
        text = "tok " * max_tokens
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        answer: dict[str, Any] = {**base, "choices": [{"index": 0, **choice}], "usage": usage}
        if config.timings:
            answer["baton_timings"] = timings
        return answer
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    async def events() -> AsyncIterator[str]:
        await asyncio.sleep(config.first_token_delay_s)
        left = max_tokens
        while left > 0:
            n = min(left, config.tokens_per_chunk)
            left -= n
            text = "tok " * n
            delta = {"delta": {"content": text}} if chat else {"text": text}
            chunk = {**base, "choices": [{"index": 0, **delta, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if left > 0:
                await asyncio.sleep(config.chunk_delay_s)
        last: dict[str, Any] = {**base, "choices": []}
        if include_usage:
            last["usage"] = usage
        if config.timings:
            last["baton_timings"] = timings
        yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=FakeServerConfig.model)
    parser.add_argument("--first-token-delay", type=float, default=0.05)
    parser.add_argument("--chunk-delay", type=float, default=0.01)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--no-timings", action="store_true", help="omit baton_timings")
    parser.add_argument("--workers", type=int, default=None, help="workers /health counts")
    parser.add_argument("--expect-workers", type=int, default=None, help="workers it expects")
    parser.add_argument(
        "--lose-worker-after",
        type=float,
        default=None,
        help="seconds after the first request until a worker leaves",
    )
    args = parser.parse_args(argv)
    config = FakeServerConfig(
        model=args.model,
        first_token_delay_s=args.first_token_delay,
        chunk_delay_s=args.chunk_delay,
        tokens_per_chunk=max(1, args.tokens_per_chunk),
        timings=not args.no_timings,
        workers=args.workers,
        expect_workers=args.expect_workers,
        lose_worker_after_s=args.lose_worker_after,
    )
    uvicorn.run(make_app(config), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
