"""Serving one prepared generation request over HTTP: admission, the run, the answer.

A request is checked against the known workers (503), admitted (it may wait in line;
refused with 429 when the line is full or too slow), then either streamed as server-sent
events or gathered into one JSON body. Errors after
a stream started become an SSE error event; before, an OpenAI-style error body. A client
that goes away cancels the run, which aborts every worker involved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from baton.common.tokenizer import Tokenizer
from baton.services.router.admission import Admission, Overloaded
from baton.services.router.attempt import EngineRequest, Timings, WorkerFailure
from baton.services.router.dispatch import Dispatcher
from baton.services.router.errors import (
    APIError,
    internal_error,
    no_workers,
    timeout_error,
    too_many_requests,
    worker_error,
)
from baton.services.router.formats import ResponseFormat
from baton.services.router.metrics import RouterMetrics
from baton.services.router.pairing import NoWorkersAvailable
from baton.services.router.params import PreparedRequest
from baton.services.router.streams import Choice, Delta, merge
from baton.services.router.tracing import RequestTrace

if TYPE_CHECKING:
    from baton.services.otel import Tracing

log = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nobody reads it; it labels the metric


class Server:
    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        metrics: RouterMetrics,
        admission: Admission,
        timeout: float | None,
        tracing: Tracing | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._admission = admission
        self._timeout = timeout
        self._tracing = tracing

    async def serve(
        self,
        request: Request,
        endpoint: str,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        arrival: float,
    ) -> Response:
        """Run `prepared` and answer in `fmt`. `arrival`: time.monotonic() at arrival."""
        if self._tracing is None:
            return await self._serve(request, endpoint, prepared, fmt, arrival, None)
        trace = RequestTrace.begin(self._tracing, request.headers, endpoint, fmt.id, arrival)
        try:
            response = await self._serve(request, endpoint, prepared, fmt, arrival, trace)
        except APIError as e:
            trace.end(e.status, e.message)
            raise
        except BaseException as e:
            trace.end(500, repr(e))
            raise
        if not isinstance(response, EventStream):  # a stream's trace ends when it closes
            trace.end(response.status_code)
        return response

    async def _serve(
        self,
        request: Request,
        endpoint: str,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        arrival: float,
        trace: RequestTrace | None,
    ) -> Response:
        if not self._dispatcher.available():
            raise no_workers()
        try:
            admitted = await _unless_disconnected(request, self._enter(trace))
        except Overloaded as e:
            raise too_many_requests(str(e)) from e
        if admitted is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        self._metrics.in_flight.labels(self._metrics.model_name).inc()
        run = _Run(
            self._choices(prepared, fmt.id, arrival),
            prepared,
            fmt,
            _Clock(arrival, self._timeout, endpoint, self._metrics),
            on_close=self._leave
            if trace is None or not prepared.stream
            else lambda: self._leave(trace),
        )
        streaming = False
        try:
            if prepared.stream:
                streaming = True  # from here the response owns the run and closes it
                return EventStream(run.events(), on_close=run.close)
            body = await _unless_disconnected(request, run.collect())
            if body is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(body)
        finally:
            if not streaming:
                run.close()

    def _choices(self, prepared: PreparedRequest, request_id: str, arrival: float) -> list[Choice]:
        choices = []
        for spec in prepared.choices:
            engine_request = EngineRequest(
                # Each choice is its own request on the workers, aborted on its own.
                request_id=request_id
                if len(prepared.choices) == 1
                else f"{request_id}-{spec.index}",
                input_ids=spec.input_ids,
                sampling=spec.sampling,
                arrival=arrival,
            )
            choices.append(
                Choice(
                    spec.index,
                    self._dispatcher.generation(engine_request),
                    self._tokenizer,
                    prepared.stop_strings,
                    prepared.skip_special_tokens,
                )
            )
        return choices

    async def _enter(self, trace: RequestTrace | None) -> bool:
        if trace is None:
            return await self._admission.enter()
        with trace.admission():
            return await self._admission.enter()

    def _leave(self, stream_trace: RequestTrace | None = None) -> None:
        self._admission.leave()
        self._metrics.in_flight.labels(self._metrics.model_name).dec()
        if stream_trace is not None:
            stream_trace.end(200)  # errors after the stream began travel in its events


@dataclass
class _Clock:
    """A request's arrival, deadline and latency metrics (TTFT, inter-token latency and
    time per output token, per choice; end to end, per request)."""

    arrival: float
    timeout: float | None
    endpoint: str
    metrics: RouterMetrics
    first_token_seen: bool = False
    # choice index -> (first token time, last token time, tokens so far)
    _choices: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    _itl: Any = None  # the inter-token histogram's series of this model and endpoint

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.arrival + self.timeout

    def note_tokens(self, index: int, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        if not self.first_token_seen:
            self.first_token_seen = True
            self.metrics.ttft.labels(self.metrics.model_name, self.endpoint).observe(
                now - self.arrival
            )
        first, last, seen = self._choices.get(index, (now, now, 0))
        if seen:
            # each token of a message is one gap of its share (looked up once a request:
            # a series lookup cost more than the observation, once a token)
            if self._itl is None:
                self._itl = self.metrics.itl.labels(self.metrics.model_name, self.endpoint)
            gap = (now - last) / count
            for _ in range(count):
                self._itl.observe(gap)
        self._choices[index] = (first, now, seen + count)

    def note_end(self) -> None:
        labels = (self.metrics.model_name, self.endpoint)
        self.metrics.e2e.labels(*labels).observe(time.monotonic() - self.arrival)
        for first, last, seen in self._choices.values():
            if seen > 1:
                self.metrics.tpot.labels(*labels).observe((last - first) / (seen - 1))


class _Run:
    """One HTTP request's generations, turned into an SSE stream or a JSON body."""

    def __init__(
        self,
        choices: list[Choice],
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        clock: _Clock,
        on_close: Callable[[], None],
    ) -> None:
        self._choices = choices
        self._prepared = prepared
        self._fmt = fmt
        self._clock = clock
        self._on_close: Callable[[], None] | None = on_close

    async def events(self) -> AsyncIterator[str]:
        fmt = self._fmt
        try:
            for chunk in fmt.opening_chunks([c.index for c in self._choices]):
                yield self._sse_with_usage(chunk)
            finished = 0
            async for delta in merge(self._choices, self._clock.deadline):
                self._clock.note_tokens(delta.index, len(delta.token_ids))
                chunk = fmt.chunk(delta)
                if delta.finish_reason:
                    finished += 1
                    if finished == len(self._choices) and not self._prepared.include_usage:
                        chunk["baton_timings"] = self._timings()
                yield self._sse_with_usage(chunk)
            if self._prepared.include_usage:
                closing = fmt.closing_chunk()
                closing["usage"] = self._usage()
                closing["baton_timings"] = self._timings()
                yield _sse(closing)
        except (NoWorkersAvailable, WorkerFailure, TimeoutError) as e:
            error = self._api_error(e)
            log.warning("request %s failed mid-stream: %s", fmt.id, error.message)
            yield error.sse_event()
        except Exception:
            log.exception("request %s failed mid-stream", fmt.id)
            yield internal_error().sse_event()
        yield "data: [DONE]\n\n"

    async def collect(self) -> Any:
        results = {c.index: Delta(c.index) for c in self._choices}
        try:
            async for delta in merge(self._choices, self._clock.deadline):
                self._clock.note_tokens(delta.index, len(delta.token_ids))
                results[delta.index].add(delta)
        except (NoWorkersAvailable, WorkerFailure, TimeoutError) as e:
            error = self._api_error(e)
            log.warning("request %s failed: %s", self._fmt.id, error.message)
            raise error from e
        return self._fmt.whole(
            [results[i] for i in sorted(results)], self._usage(), self._timings()
        )

    def close(self) -> None:
        """Once, however the request ended: give back its admission slot, note latency,
        tokens and how each choice finished."""
        if self._on_close is None:
            return
        self._on_close()
        self._on_close = None
        self._clock.note_end()
        metrics = self._clock.metrics
        usage = self._usage()
        metrics.prompt_tokens.labels(metrics.model_name).inc(usage["prompt_tokens"])
        metrics.generation_tokens.labels(metrics.model_name).inc(usage["completion_tokens"])
        for choice in self._choices:
            if choice.finish_reason is not None:
                metrics.finished_choices.labels(metrics.model_name, choice.finish_reason).inc()

    def _sse_with_usage(self, chunk: dict[str, Any]) -> str:
        if self._prepared.continuous_usage:
            chunk["usage"] = self._usage()  # the tokens so far, as vLLM's chunks carry them
        return _sse(chunk)

    def _usage(self) -> dict[str, Any]:
        n = self._prepared.n
        per_prompt = [self._choices[i : i + n] for i in range(0, len(self._choices), n)]
        prompt = sum(group[0].prompt_tokens for group in per_prompt)
        completion = sum(c.completion_tokens for c in self._choices)
        cached = sum(max(c.generation.cached_tokens for c in group) for group in per_prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _timings(self) -> dict[str, float | str]:
        return Timings.worst([c.generation.timings for c in self._choices]).as_dict()

    def _api_error(self, e: Exception) -> APIError:
        if isinstance(e, NoWorkersAvailable):
            return no_workers()
        if isinstance(e, TimeoutError):
            return timeout_error(self._clock.timeout or 0.0)
        return worker_error(str(e))


class EventStream(StreamingResponse):
    """A server-sent event stream that runs `on_close` however it ends, even if the
    client left before the first byte (when the body iterator never starts)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# Line separators JSON leaves raw but Unicode-aware line splitters (Python's str.splitlines,
# httpx's aiter_lines) break an event on; escaped, the event stays one line.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj: dict[str, Any]) -> str:
    data = json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKERS)
    return f"data: {data}\n\n"


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None (and `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        log.info("client disconnected from %s; request aborted", request.url.path)
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
