"""A request's trace on the router: its span, the admission line, and one span per call
to a worker, whose context the worker receives as `traceparent` gRPC metadata.

```
POST /v1/chat/completions            (server; parent: the client's traceparent, if any)
├─ baton.router.prepare              chat template, tokenizing, validation
├─ baton.router.admission            waiting for a slot (a 429 marks it failed)
├─ baton.router.placement            waiting for workers, choosing them (kind, reason)
├─ baton.router.prefill  prefill-0  attempt 0   the Generate stream to P ─┐ the workers'
├─ baton.router.decode   decode-0   attempt 0   the Generate stream to D ─┤ own spans hang
├─ baton.router.rerun    migration              the back-off and why       │ under these
├─ baton.router.placement                       placed again               │
└─ baton.router.decode   decode-1   attempt 1   a migration: D again      ─┘
```

`RequestTrace.begin` makes the request's trace the current one (a context variable, so
the tasks the request starts inherit it, as OpenTelemetry's own context does), and
`generate` opens each worker stream under it: with `placing`/`placed` and `rerun`, the
few lines of the dispatch path that know about tracing. A rerun's calls carry its attempt number (`-retryN` in the
request id) and kind (`retry` before any output, `migration` after; `rerun` says which,
the one line of the rerun path), so a migrated stream's trace shows both decode workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.state import SpanValue
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import ROLE_NAMES

if TYPE_CHECKING:
    from baton.services.otel import OpenSpan, Tracing
    from baton.services.router.placement import Placement

_current: ContextVar[RequestTrace | None] = ContextVar("baton_request_trace", default=None)
_finishing: set[asyncio.Task[None]] = set()  # ends of calls reading their status


def generate(worker: WorkerHandle, request: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
    """`worker.stub.Generate(request)`, traced under the current request when it is."""
    trace = _current.get()
    if trace is None:
        return worker.stub.Generate(request)
    return trace.call(worker, request)


def placing() -> int | None:
    """The current request's wait for workers and its placement begin: when (its end:
    `placed`); None when it is not traced."""
    trace = _current.get()
    return None if trace is None else trace.placing()


def placed(since: int | None, placement: Placement | None, *workers: WorkerHandle | None) -> None:
    """The placement `placing` began chose `workers` (None: D computes the prompt itself);
    `placement` None: a single worker's pick."""
    trace = _current.get()
    if since is not None and trace is not None:
        trace.dispatched = time.time_ns()  # the calls' spans start here, not in their task
        kind, reason = (placement.kind, placement.reason) if placement else ("single", "")
        chosen = " -> ".join(w.worker_id if w else "local" for w in workers)
        attributes = {"baton.placement": kind, "baton.placement_reason": reason}
        attributes["baton.workers"] = chosen
        trace.record("baton.router.placement", since, trace.dispatched, attributes)


def rerun(kind: str, reason: str) -> None:
    """The current request runs again (`kind`: retry | migration | handed_back) after
    `reason`."""
    trace = _current.get()
    if trace is not None:
        trace.rerunning(kind, reason)


class RequestTrace:
    def __init__(self, tracing: Tracing, span: OpenSpan) -> None:
        self._tracing = tracing
        self.span = span
        self._attempt_kind = "first"
        self._rerun: OpenSpan | None = None  # from a failure to the next attempt's placement
        self.dispatched: int | None = None  # time.time_ns() the latest placement was made

    @staticmethod
    def begin(
        tracing: Tracing, headers: Mapping[str, str], endpoint: str, request_id: str, arrival: float
    ) -> RequestTrace:
        """The request's span, from `arrival` (time.monotonic()), made current."""
        arrived_ns = time.time_ns() - int((time.monotonic() - arrival) * 1e9)
        attributes = {
            "http.request.method": "POST",
            "http.route": endpoint,
            "baton.request_id": request_id,
        }
        span = tracing.begin(
            f"POST {endpoint}", tracing.extract(headers), arrived_ns, attributes, "server"
        )
        trace = RequestTrace(tracing, span)
        # From arrival to here: parsing, the chat template, tokenizing, validation.
        trace.record("baton.router.prepare", arrived_ns, time.time_ns())
        _current.set(trace)
        return trace

    def admission(self) -> OpenSpan:
        """The wait for a slot, as a span over a block (a refusal marks it failed)."""
        return self._tracing.begin("baton.router.admission", self.span.context)

    def rerunning(self, kind: str, reason: str) -> None:
        self._end_rerun()
        self._attempt_kind = kind
        attributes = {"baton.attempt_kind": kind, "baton.rerun_reason": reason}
        self._rerun = self._tracing.begin("baton.router.rerun", self.span.context, None, attributes)

    def placing(self) -> int:
        self._end_rerun()
        return time.time_ns()

    def record(
        self, name: str, start_ns: int, end_ns: int, attributes: dict[str, str] | None = None
    ) -> None:
        """A span of the request whose times are known now."""
        self._tracing.record(name, self.span.context, start_ns, end_ns, attributes)

    def _end_rerun(self) -> None:
        if self._rerun is not None:
            self._rerun.end()
            self._rerun = None

    def call(self, worker: WorkerHandle, request: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        self._end_rerun()
        role = ROLE_NAMES.get(worker.role, "worker")
        _, _, retry = request.request_id.rpartition("-retry")
        attributes: dict[str, SpanValue] = {
            "rpc.system": "grpc",
            "rpc.method": "Generate",
            "server.address": worker.info.grpc_address,
            "baton.worker_id": worker.worker_id,
            "baton.role": role,
            "baton.room": str(request.room),
            "baton.attempt": int(retry) if retry.isdigit() else 0,
            "baton.attempt_kind": self._attempt_kind,  # first | retry | migration
            "baton.prompt_tokens": len(request.input_ids),
        }
        span = self._tracing.begin(
            f"baton.router.{'worker' if role == 'both' else role}",
            self.span.context,
            self.dispatched,  # None: now
            attributes,
            "client",
        )
        metadata = tuple(self._tracing.inject(span.context).items())
        call = worker.stub.Generate(request, metadata=metadata)
        call.add_done_callback(lambda done: _end_call(span, done))
        return call

    def end(self, status: int, error: str = "") -> None:
        """Once: the answer's HTTP status, and what went wrong if anything did."""
        if self.span.ended:
            return
        self._end_rerun()
        self.span.set("http.response.status_code", status)
        if status >= 500:
            self.span.fail(error or str(status))
        elif error:  # the client's error or a refusal (4xx): no failure of the server's
            self.span.set("baton.refusal", error)
        self.span.end()


def _end_call(span: OpenSpan, call: grpc.aio.Call) -> None:
    """The stream ended (finished, failed, or cancelled by the router): its status lands
    on the span once readable, at the time it ended."""
    ended_ns = time.time_ns()
    if call.cancelled():
        span.set("baton.cancelled", True)  # the router let go of it: no error
        span.end(ended_ns)
        return

    async def finish() -> None:
        code = await call.code()
        if code != grpc.StatusCode.OK:
            span.fail(f"{code.name}: {await call.details()}")
        span.end(ended_ns)

    task = asyncio.get_running_loop().create_task(finish())
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)
