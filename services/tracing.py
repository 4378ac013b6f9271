"""OpenTelemetry tracing, shared by the router and the workers: off unless asked for.

`--otlp-traces-endpoint URL` (an OTLP/gRPC collector, e.g. http://collector:4317), or the
standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, turns it
on; `OTEL_SDK_DISABLED=true` keeps it off. The sampler is `--otlp-traces-sample-ratio`
(of the traces that start here; a request that arrives with a trace context follows its
parent's decision), else the SDK's reading of `OTEL_TRACES_SAMPLER(_ARG)`, else every
request. The rest of the SDK's `OTEL_*` variables apply as the SDK reads them (service
name, resource attributes, batch delays, exporter headers and timeouts). Trace context
crosses processes as W3C `traceparent` (HTTP headers from clients, gRPC metadata to the
workers).

Off, nothing of OpenTelemetry's SDK is imported and callers hold `None`: a request costs
one test of it per place that could trace.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from baton.common import env
from baton.common.options import option

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Span, SpanContext, Tracer
    from prometheus_client import CollectorRegistry, Counter

GROUP = "tracing"


def endpoint_option() -> Any:
    return option(
        None,
        "send a trace of every sampled request to this OTLP/gRPC collector, e.g. "
        "http://127.0.0.1:4317 (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)",
        group=GROUP,
    )


def sample_ratio_option() -> Any:
    return option(
        None,
        "share of the requests without a client trace context that are traced, in [0, 1] "
        "(default: OTEL_TRACES_SAMPLER, else all)",
        group=GROUP,
    )


def check_endpoint(endpoint: str | None) -> str | None:
    """Why `endpoint` is refused, or None."""
    if endpoint is not None and not re.fullmatch(r"https?://[^/\s]+/?", endpoint):
        return "must be the collector's URL, e.g. http://127.0.0.1:4317"
    return None


def check_sample_ratio(ratio: float | None) -> str | None:
    """Why `ratio` is refused, or None."""
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        return "must be in [0, 1]"
    return None


@dataclass(frozen=True)
class Tracing:
    """A tracer exporting over OTLP/gRPC, and how its context crosses processes."""

    tracer: Tracer
    provider: TracerProvider
    processor: SpanProcessor  # the batch processor: `record` hands it finished spans
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
    ) -> Tracing | None:
        """The process's tracing, or None while it is off (see the module's docstring).
        With `metrics`, the spans exported and those the collector refused or never got
        are counted there as `<metric_prefix>_trace_spans_total{outcome}`. `instance`
        names this process among those of its service (a worker's id)."""
        if env.OTEL_SDK_DISABLED.get():
            return None
        if not (endpoint or env.OTEL_TRACES_ENDPOINT.get() or env.OTEL_ENDPOINT.get()):
            return None
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError as e:
            raise ImportError(
                f"tracing needs OpenTelemetry's SDK and OTLP exporter ({e.name} is missing): "
                "pip install 'baton[tracing]'"
            ) from e

        sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
        name = env.OTEL_SERVICE_NAME.get() or service_name
        provider = TracerProvider(
            sampler=sampler,  # None: the SDK's, from OTEL_TRACES_SAMPLER
            resource=Resource.create(
                {"service.name": name, **({"service.instance.id": instance} if instance else {})}
            ),
            shutdown_on_exit=False,  # the processes exit through os._exit: shutdown() does
        )
        # endpoint None: the exporter reads the OTEL_* variables
        exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint)
        if metrics is not None:
            exporter = _counted(exporter, _span_counter(metrics, metric_prefix))
        processor = BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
        scope = InstrumentationScope("baton")
        return Tracing(
            provider.get_tracer("baton"), provider, processor, RandomIdGenerator(), scope
        )

    def record(
        self,
        name: str,
        parent: SpanContext,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, str | int | float | bool] | None = None,
        links: Sequence[SpanContext] = (),
        events: Sequence[tuple[str, int]] = (),
    ) -> SpanContext:
        """A span whose times are known when it is made, under `parent`, sent at once (if
        `parent` is sampled): a tenth of a live span's cost (no lock, sampler or start
        hooks). Its context, for children of its own."""
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import Link, SpanContext

        context = SpanContext(
            parent.trace_id,
            self.ids.generate_span_id(),
            False,
            parent.trace_flags,
            parent.trace_state,
        )
        if parent.trace_flags.sampled:
            span = ReadableSpan(
                name,
                context,
                parent,
                self.provider.resource,
                attributes,
                [Event(event, timestamp=at) for event, at in events],
                [Link(link) for link in links],
                start_time=start_ns,
                end_time=end_ns,
                instrumentation_scope=self.scope,
            )
            self.processor.on_end(span)
        return context

    def shutdown(self) -> None:
        """Send the spans still batched, then stop exporting."""
        self.provider.shutdown()


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


def _counted(exporter: SpanExporter, counter: Counter) -> SpanExporter:
    """`exporter`, counting the spans of each export by its outcome."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Counted(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            result = exporter.export(spans)
            outcome = "exported" if result is SpanExportResult.SUCCESS else "failed"
            counter.labels(outcome).inc(len(spans))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return exporter.force_flush(timeout_millis)

    return Counted()


def extract(carrier: Mapping[str, str]) -> Context:
    """The trace context a W3C `traceparent` (and `tracestate`) in `carrier` names; an
    empty context without one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def inject(span: Span) -> dict[str, str]:
    """`span`'s context as W3C headers (`traceparent`, `tracestate`) for the next hop."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier
