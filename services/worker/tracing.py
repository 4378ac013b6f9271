"""A Generate stream's spans on a worker, under the router's call span (`traceparent` in
the call's gRPC metadata; services/router/tracing.py).

The scheduler loop is not instrumented: when the stream ends, its spans are built from
the times the frontend saw (the call's arrival, each message sent) and the per-stage
seconds the scheduler reports with the finish (`TokenOut.timings`), laid end to end
from the arrival:

```
baton.worker.generate          the stream, arrival to its end (server)
  P:    baton.prefill.queue → baton.prefill.compute            (queue, prefill)
  D:    baton.decode.admission → baton.kv_transfer → baton.decode  (first/last token events)
  both: baton.prefill.queue → baton.prefill.compute → baton.decode
```
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc.aio

from baton.common.protocol import TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.services.tracing import Tracing, extract

if TYPE_CHECKING:
    from opentelemetry.context import Context


class StreamTrace:
    def __init__(
        self,
        tracing: Tracing,
        context: grpc.aio.ServicerContext,
        request: pb.GenerateRequest,
        role: str,
    ) -> None:
        metadata = context.invocation_metadata() or ()
        self._parent = extract({str(k): str(v) for k, v in metadata if isinstance(v, str)})
        self._tracing = tracing
        self._role = role
        self._request_id = request.request_id
        self._room = request.room
        self._arrived = time.time_ns()
        self._first_token: int | None = None
        self._last_token: int | None = None
        self._finish: TokenOut | None = None

    def sent(self, out: TokenOut) -> None:
        """A message left for the router."""
        if out.token_ids:
            self._last_token = time.time_ns()
            if self._first_token is None:
                self._first_token = self._last_token
        if out.finished:
            self._finish = out

    def end(self) -> None:
        """The stream ended (finished, or aborted before)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        ended = time.time_ns()
        out = self._finish
        root = self._tracing.tracer.start_span(
            "baton.worker.generate",
            context=self._parent,
            kind=SpanKind.SERVER,
            start_time=self._arrived,
            attributes={
                "rpc.system": "grpc",
                "rpc.method": "Generate",
                "baton.role": self._role,
                "baton.request_id": self._request_id,
                "baton.room": str(self._room),
            },
        )
        if out is None:
            root.set_attribute("baton.aborted", True)  # the router let go, or we failed
        else:
            root.set_attributes(
                {
                    "baton.finish_reason": out.finish_reason,
                    "baton.prompt_tokens": out.prompt_tokens,
                    "baton.cached_tokens": out.cached_tokens,
                    "baton.completion_tokens": out.completion_tokens,
                }
            )
            if out.finish_reason == "error":
                root.set_status(Status(StatusCode.ERROR, out.error))
            self._stages(set_span_in_context(root), out.timings, ended)
        root.end(end_time=ended)

    def _stages(self, parent: Context, timings: dict[str, float], ended: int) -> None:
        stages: list[tuple[str, float | None]] = []  # (name, seconds; None: to the end)
        if self._role in ("prefill", "both"):
            stages += [("baton.prefill.queue", timings.get("queue", 0.0))]
            stages += [("baton.prefill.compute", timings.get("prefill", 0.0))]
        if self._role == "decode":
            stages += [("baton.decode.admission", timings.get("decode_admission", 0.0))]
            stages += [("baton.kv_transfer", timings.get("kv_transfer", 0.0))]
        if self._role in ("decode", "both"):
            stages += [("baton.decode", None)]
        at = self._arrived
        for name, seconds in stages:
            end = ended if seconds is None else min(at + int(seconds * 1e9), ended)
            span = self._tracing.tracer.start_span(name, context=parent, start_time=at)
            if name == "baton.decode":
                for event, when in (
                    ("first_token", self._first_token),
                    ("last_token", self._last_token),
                ):
                    if when is not None:
                        span.add_event(event, timestamp=when)
            span.end(end_time=end)
            at = end
