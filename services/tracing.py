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

Off, nothing of OpenTelemetry's SDK is imported (`services/otel.py` is, when on) and
callers hold `None`: a request costs one test of it per place that could trace.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from baton.common import env
from baton.common.options import option

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from baton.services.otel import Tracing

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


def start_tracing(
    service_name: str,
    endpoint: str | None,
    ratio: float | None,
    metrics: CollectorRegistry | None = None,
    metric_prefix: str = "baton",
    instance: str | None = None,
) -> Tracing | None:
    """The process's tracing, or None while it is off (see the module's docstring).
    With `metrics`, the spans exported and those the collector refused or never got are
    counted there as `<metric_prefix>_trace_spans_total{outcome}`. `instance` names this
    process among those of its service (a worker's id)."""
    if env.OTEL_SDK_DISABLED.get():
        return None
    if not (endpoint or env.OTEL_TRACES_ENDPOINT.get() or env.OTEL_ENDPOINT.get()):
        return None
    try:
        from baton.services.otel import Tracing
    except ImportError as e:
        raise ImportError(
            f"tracing needs OpenTelemetry's SDK and OTLP exporter ({e.name} is missing): "
            "pip install 'baton[tracing]'"
        ) from e
    name = env.OTEL_SERVICE_NAME.get() or service_name
    return Tracing.start(name, endpoint, ratio, metrics, metric_prefix, instance)
