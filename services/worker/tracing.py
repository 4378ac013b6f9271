"""A Generate stream's spans on a worker, under the router's call span (`traceparent` in
the call's gRPC metadata; services/router/tracing.py).

The scheduler loop makes no OpenTelemetry call. The worker's span of the request starts
when the stream arrives, and its context goes to the scheduler with the request
(`GenerateReq.traceparent`); the scheduler records, as plain values, what only it sees
(`common/state.py: RequestSpans`: each prompt chunk, a retraction, the room's KV transfer)
and sends them before the finish (`SpansOut`). When the stream ends, its spans are built
here from those records, the times the frontend saw (arrival, each message sent) and the
per-stage seconds of the finish (`TokenOut.timings`), laid end to end from the arrival:

```
baton.worker.generate          the stream, arrival to its end (server)
  P:    baton.prefill.queue → baton.prefill.compute ⊃ baton.prefill.chunk …
        baton.kv_transfer.send   (recorded once the room ended, after the stream: sent
                                  on its own, under this stream's span)
  D:    baton.decode.admission → baton.kv_transfer.receive → baton.decode ⊃ baton.retracted
  both: baton.prefill.queue → baton.prefill.compute ⊃ chunks → baton.decode
```

A room's two transfer spans link to each other's request span: the KV control messages
carry each side's context (`common/transfer/messages.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc.aio

from baton.common.protocol import SpansOut, TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.state import SpanRecord, SpanValue

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from baton.services.otel import Tracing

# A record's parent, when not the worker's span: the stage that contains it.
_STAGE_OF = {"baton.prefill.chunk": "baton.prefill.compute", "baton.retracted": "baton.decode"}
# Stages laid out from the timings but built by the scheduler's records (their real times,
# and what only it knows): D's transfer is its `baton.kv_transfer.receive`.
_RECORDED = {"baton.kv_transfer"}


class StreamTrace:
    def __init__(
        self,
        tracing: Tracing,
        context: grpc.aio.ServicerContext,
        request: pb.GenerateRequest,
        role: str,
        received: float | None = None,
    ) -> None:
        """`received`: time.monotonic() when the frontend got the request (what `ingress`
        counts from), so the stages lie where they ran; now if not given."""
        metadata = context.invocation_metadata() or ()
        parent = tracing.extract({str(k): str(v) for k, v in metadata if isinstance(v, str)})
        self._tracing = tracing
        self._role = role
        since = 0.0 if received is None else max(0.0, time.monotonic() - received)
        self._arrived = time.time_ns() - int(since * 1e9)
        attributes: dict[str, SpanValue] = {
            "rpc.system": "grpc",
            "rpc.method": "Generate",
            "baton.role": role,
            "baton.request_id": request.request_id,
            "baton.room": str(request.room),
        }
        self.root = tracing.begin(
            "baton.worker.generate", parent, self._arrived, attributes, "server"
        )
        # for the scheduler: what it records hangs under this span (none when unsampled)
        sampled = self.root.sampled
        self.traceparent = tracing.inject(self.root.context)["traceparent"] if sampled else None
        self._first_token: int | None = None
        self._last_token: int | None = None
        self._finish: TokenOut | None = None
        self._records: list[SpanRecord] = []

    def recorded(self, spans: Iterable[SpanRecord]) -> None:
        """The scheduler's records of this request (before its finish)."""
        self._records.extend(spans)

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
        ended = time.time_ns()
        root, out = self.root, self._finish
        if not root.sampled:
            return
        stages: dict[str, SpanContext] = {}
        if out is None:
            root.set("baton.aborted", True)  # the router let go, or we failed
        else:
            root.set("baton.finish_reason", out.finish_reason)
            root.set("baton.prompt_tokens", out.prompt_tokens)
            root.set("baton.cached_tokens", out.cached_tokens)
            root.set("baton.completion_tokens", out.completion_tokens)
            if out.finish_reason == "error":
                root.fail(out.error)
            stages = self._stages(out, ended)
        for record in self._records:
            stage = stages.get(_STAGE_OF.get(record.name, ""), root.context)
            emit(self._tracing, record, stage)
        root.end(ended)

    def _stages(self, out: TokenOut, ended: int) -> dict[str, SpanContext]:
        """The stages, sent: their contexts, for the records that go under them."""
        timings = out.timings
        stages: list[tuple[str, float | None]] = []  # (name, seconds; None: to the end)
        if self._role in ("prefill", "both"):
            stages += [("baton.prefill.queue", timings.get("queue", 0.0))]
            stages += [("baton.prefill.compute", timings.get("prefill", 0.0))]
        if self._role == "decode":
            stages += [("baton.decode.admission", timings.get("decode_admission", 0.0))]
            stages += [("baton.kv_transfer", timings.get("kv_transfer", 0.0))]
        if self._role in ("decode", "both"):
            stages += [("baton.decode", None)]
        parent = self.root.context
        # the stages begin once the scheduler took the request (`ingress` after it came)
        at, built = self._arrived + int(timings.get("ingress", 0.0) * 1e9), {}
        for name, seconds in stages:
            end = ended if seconds is None else min(at + int(seconds * 1e9), ended)
            if name == "baton.decode":
                retractions = sum(r.name == "baton.retracted" for r in self._records)
                attributes = {
                    "baton.completion_tokens": out.completion_tokens,
                    "baton.retractions": retractions,
                }
                events = [
                    (event, when)
                    for event, when in (
                        ("first_token", self._first_token),
                        ("last_token", self._last_token),
                    )
                    if when is not None
                ]
                built[name] = self._tracing.record(name, parent, at, end, attributes, (), events)
            elif name not in _RECORDED:
                built[name] = self._tracing.record(name, parent, at, end)
            at = end
        return built


def emit_late(tracing: Tracing, spans: SpansOut) -> None:
    """Records that came after their stream ended (P's KV transfer), under its span."""
    parent = tracing.span_context(spans.traceparent)
    for record in spans.spans:
        emit(tracing, record, parent)


def emit(tracing: Tracing, record: SpanRecord, parent: SpanContext) -> None:
    """`record` as a span under `parent`, linked to the spans it names."""
    offset = time.time_ns() - time.monotonic_ns()  # the records' clock is the host's
    start, end = int(record.start * 1e9) + offset, int(record.end * 1e9) + offset
    links = [tracing.span_context(link) for link in record.links]
    tracing.record(record.name, parent, start, end, record.attributes, links)
