"""OpenTelemetry's SDK behind baton's traces, imported only when tracing is on
(`services/tracing.py: start_tracing`).

Every span is made here, finished, as the SDK's `ReadableSpan` (what the OTLP exporter
encodes) and handed to the SDK's batch processor, whose thread encodes and exports it: a
span whose times are known at once through `Tracing.record`, one under way through
`Tracing.begin` (an `OpenSpan`, sent when it ends). The SDK's live span would cost three
times as much (a lock, attribute limits, the processors' start hooks, the current-context
machinery) for nothing baton uses, and this module imports the SDK's names once rather
than in each call that makes a span (an import statement costs ~1.5 µs). A span under one
of this process's follows its parent's sampling decision; one whose parent is another
process's (an extracted context, perhaps empty) asks the sampler.

What is left is mostly the exporter's: ~10 µs to encode a span and ~3 µs per attribute
(`benchmarks/results/tracing_overhead.md`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from baton.common.state import SpanValue

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter

Kind = Literal["internal", "server", "client"]
_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}
_PROPAGATOR = TraceContextTextMapPropagator()
_UNSET = Status()
_SAMPLED = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_NOT_SAMPLED = TraceFlags(TraceFlags.RANDOM_TRACE_ID)


@dataclass(frozen=True)
class Tracing:
    """A process's spans, exported over OTLP/gRPC, and how their context crosses
    processes (W3C `traceparent`)."""

    provider: TracerProvider  # its sampler and resource; its shutdown flushes the processor
    processor: SpanProcessor  # the batch processor: finished spans go to its on_end
    ids: IdGenerator
    scope: InstrumentationScope

    @staticmethod
    def start(
        service_name: str,
        endpoint: str | None,
        ratio: float | None,
        metrics: CollectorRegistry | None = None,
        metric_prefix: str = "baton",
        instance: str | None = None,
    ) -> Tracing:
        """See `services/tracing.py: start_tracing`."""
        sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
        resource = Resource.create(
            {
                "service.name": service_name,
                **({"service.instance.id": instance} if instance else {}),
            }
        )
        provider = TracerProvider(
            sampler=sampler,  # None: the SDK's, from OTEL_TRACES_SAMPLER
            resource=_hashed_once(resource),
            shutdown_on_exit=False,  # the processes exit through os._exit: shutdown() does
        )
        # endpoint None: the exporter reads the OTEL_* variables
        exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint)
        if metrics is not None:
            exporter = _Counted(exporter, _span_counter(metrics, metric_prefix))
        processor = BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return Tracing(provider, processor, RandomIdGenerator(), InstrumentationScope("baton"))

    def record(
        self,
        name: str,
        parent: SpanContext,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, SpanValue] | None = None,
        links: Sequence[SpanContext] = (),
        events: Sequence[tuple[str, int]] = (),
    ) -> SpanContext:
        """A span whose times are known when it is made, under `parent`, sent at once (if
        `parent` is sampled). Its context, for children of its own."""
        context = SpanContext(
            parent.trace_id,
            self.ids.generate_span_id(),
            False,
            parent.trace_flags,
            parent.trace_state,
        )
        if parent.trace_flags.sampled:
            self.send(name, context, parent, start_ns, end_ns, attributes, links, events)
        return context

    def begin(
        self,
        name: str,
        parent: SpanContext | Context,
        start_ns: int | None = None,
        attributes: Mapping[str, SpanValue] | None = None,
        kind: Kind = "internal",
    ) -> OpenSpan:
        """A span from `start_ns` (None: now) until its `end`, under `parent`: a span of
        this process (its context), or another process's (`extract`'s context, perhaps
        empty: a new trace), in which case the sampler decides."""
        start_ns = time.time_ns() if start_ns is None else start_ns
        attributes = dict(attributes or {})  # (the sampler's are added: the caller's stays)
        span_id = self.ids.generate_span_id()
        if isinstance(parent, SpanContext):  # ours: its decision holds
            flags, state = parent.trace_flags, parent.trace_state
            context = SpanContext(parent.trace_id, span_id, False, flags, state)
            return OpenSpan(self, name, context, parent, start_ns, attributes, kind)
        remote = get_current_span(parent).get_span_context()
        trace_id = remote.trace_id if remote.is_valid else self.ids.generate_trace_id()
        sampled = self.provider.sampler.should_sample(
            parent, trace_id, name, _KINDS[kind], attributes
        )
        flags = _SAMPLED if sampled.decision.is_sampled() else _NOT_SAMPLED
        if remote.is_valid and not remote.trace_flags.random_trace_id:
            flags = TraceFlags(flags & ~TraceFlags.RANDOM_TRACE_ID)
        attributes.update(sampled.attributes or {})
        context = SpanContext(trace_id, span_id, False, flags, sampled.trace_state)
        parent_context = remote if remote.is_valid else None
        return OpenSpan(self, name, context, parent_context, start_ns, attributes, kind)

    def send(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, SpanValue] | None,
        links: Sequence[SpanContext] = (),
        events: Sequence[tuple[str, int]] = (),
        kind: Kind = "internal",
        status: Status = _UNSET,
    ) -> None:
        """A finished span to the batch processor."""
        span = ReadableSpan(
            name,
            context,
            parent,
            self.provider.resource,
            attributes,
            tuple(Event(event, timestamp=at) for event, at in events),
            tuple(Link(link) for link in links),
            kind=_KINDS[kind],
            status=status,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=self.scope,
        )
        self.processor.on_end(span)

    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context:
        """The trace context a W3C `traceparent` (and `tracestate`) in `carrier` names;
        an empty context without one."""
        return _PROPAGATOR.extract(carrier)

    @staticmethod
    def span_context(traceparent: str) -> SpanContext:
        """The span a W3C `traceparent` names (an invalid context for a malformed one)."""
        return get_current_span(
            _PROPAGATOR.extract({"traceparent": traceparent})
        ).get_span_context()

    @staticmethod
    def inject(context: SpanContext) -> dict[str, str]:
        """The W3C headers (`traceparent`, `tracestate`) carrying `context` to the next
        hop."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(NonRecordingSpan(context)))
        return carrier

    def shutdown(self) -> None:
        """Send the spans still batched, then stop exporting."""
        self.provider.shutdown()


class OpenSpan:
    """A span under way (`Tracing.begin`): its context is known from the start, for
    children and the next hop; it is sent when it ends, once, if sampled. A span over a
    block as a context manager, failed if the block raises."""

    __slots__ = (
        "_attributes",
        "_kind",
        "_parent",
        "_start",
        "_status",
        "_tracing",
        "context",
        "ended",
        "name",
    )

    def __init__(
        self,
        tracing: Tracing,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ns: int,
        attributes: dict[str, SpanValue],
        kind: Kind,
    ) -> None:
        self._tracing = tracing
        self.name = name
        self.context = context
        self._parent = parent
        self._start = start_ns
        self._attributes = attributes
        self._kind: Kind = kind
        self._status = _UNSET
        self.ended = False

    @property
    def sampled(self) -> bool:
        return self.context.trace_flags.sampled

    def set(self, key: str, value: SpanValue) -> None:
        self._attributes[key] = value

    def fail(self, description: str) -> None:
        """The span's status: an error, and why."""
        self._status = Status(StatusCode.ERROR, description)

    def end(self, end_ns: int | None = None) -> None:
        """At `end_ns` (None: now); later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        if self.context.trace_flags.sampled:
            end_ns = time.time_ns() if end_ns is None else end_ns
            self._tracing.send(
                self.name,
                self.context,
                self._parent,
                self._start,
                end_ns,
                self._attributes,
                kind=self._kind,
                status=self._status,
            )

    def __enter__(self) -> OpenSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: object, tb: object) -> None:
        if kind is not None:
            self.fail(f"{kind.__name__}: {error}")
        self.end()


def _hashed_once(resource: Resource) -> Resource:
    """`resource`, computing its hash once: the OTLP encoder groups each export's spans by
    resource, hashing it per span, and a resource hashes a JSON dump of its attributes
    (an eighth of what encoding a span costs)."""

    class HashedOnce(Resource):
        def __init__(self) -> None:
            super().__init__(resource.attributes, resource.schema_url)
            self._hash = hash(resource)

        def __hash__(self) -> int:
            return self._hash

        def __eq__(self, other: object) -> bool:
            return Resource.__eq__(self, other)

    return HashedOnce()


def _span_counter(registry: CollectorRegistry, prefix: str) -> Counter:
    from prometheus_client import Counter

    counter = Counter(
        f"{prefix}_trace_spans",
        "Spans of request traces sent to the OTLP collector: exported, or failed (refused, "
        "unreachable, timed out; the exporter has retried)",
        ["outcome"],
        registry=registry,
    )
    for outcome in ("exported", "failed"):
        counter.labels(outcome)
    return counter


class _Counted(SpanExporter):
    """An exporter counting the spans of each export by its outcome."""

    def __init__(self, exporter: SpanExporter, counter: Counter) -> None:
        self._exporter = exporter
        self._counter = counter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        outcome = "exported" if result is SpanExportResult.SUCCESS else "failed"
        self._counter.labels(outcome).inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._exporter.force_flush(timeout_millis)
