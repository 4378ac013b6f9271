"""Tracing's switch: off unless an endpoint is given (flag or OTEL_* variable), off then
without importing OpenTelemetry's SDK, and the settings a config refuses; a worker's
spans from the scheduler's records."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from baton.common.options import ConfigError
from baton.common.protocol import SpansOut, TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.state import SpanRecord
from baton.services.otel import Tracing
from baton.services.router.config import RouterConfig
from baton.services.router.tracing import RequestTrace
from baton.services.tracing import start_tracing
from baton.services.worker.tracing import StreamTrace, emit_late

_OTEL = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_off_by_default_without_loading_the_sdk() -> None:
    check = (
        "import sys\n"
        "from baton.services.router.app import create_app\n"
        "from baton.services.router.config import RouterConfig\n"
        "from baton.services.tracing import start_tracing\n"
        "assert RouterConfig().otlp_traces_endpoint is None\n"
        "assert start_tracing('baton-router', None, None) is None\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry.sdk')]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], env=_OTEL, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_standard_variables_turn_it_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")
    tracing = start_tracing("baton-router", None, 0.5)
    assert tracing is not None
    try:
        resource = tracing.provider.resource.attributes
        assert resource["service.name"] == "baton-router"
        assert "TraceIdRatioBased{0.5}" in tracing.provider.sampler.get_description()
    finally:
        tracing.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert start_tracing("baton-router", "http://127.0.0.1:1", None) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("otlp_traces_endpoint", "collector:4317"),  # no scheme: the exporter would use TLS
        ("otlp_traces_endpoint", "http://collector:4317/v1/traces"),  # HTTP's path, not gRPC's
        ("otlp_traces_sample_ratio", 1.5),
        ("otlp_traces_sample_ratio", -0.1),
    ],
)
def test_settings_refused_with_their_flag(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as refused:
        RouterConfig(**{field: value})  # type: ignore[arg-type]
    assert refused.value.flag == "--" + field.replace("_", "-")


def _in_memory(ratio: float = 1.0) -> tuple[Tracing, Any]:
    """A Tracing that keeps its spans in memory (as the OTLP exporter would send them),
    sampling `ratio` of the traces that start here."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    scope = InstrumentationScope("baton")
    tracing = Tracing(provider, processor, RandomIdGenerator(), scope)
    return tracing, exporter


class _Call:
    def __init__(self, traceparent: str) -> None:
        self._metadata = (("traceparent", traceparent),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


TRACE = "ab" * 16


@pytest.mark.parametrize("flags", ["01", "00"])
def test_a_streams_records_hang_under_its_stages_and_an_unsampled_one_records_nothing(
    flags: str,
) -> None:
    """What the scheduler recorded lands under the worker's span (a chunk under the compute
    stage), P's late transfer span under it too, linked to D's; a stream whose parent was
    not sampled asks the scheduler for nothing and sends no span."""
    tracing, exporter = _in_memory()
    request = pb.GenerateRequest(request_id="r1", room=7)
    trace = StreamTrace(tracing, _Call(f"00-{TRACE}-{'cd' * 8}-{flags}"), request, "prefill")  # type: ignore[arg-type]
    if flags == "00":
        assert trace.traceparent is None
        trace.end()
        assert exporter.get_finished_spans() == ()
        return
    assert trace.traceparent is not None and TRACE in trace.traceparent
    now = time.monotonic()
    trace.recorded([SpanRecord("baton.prefill.chunk", now, now + 0.01, {"baton.chunk_tokens": 16})])
    timings = {"queue": 0.001, "prefill": 0.02}
    trace.sent(TokenOut("r1", [5], finished=True, finish_reason="length", timings=timings))
    trace.end()
    d_span = f"00-{TRACE}-{'ef' * 8}-01"
    late = SpanRecord("baton.kv_transfer.send", now, now + 0.02, {"baton.kv.pages": 2}, [d_span])
    emit_late(tracing, SpansOut("r1", trace.traceparent, [late]))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["baton.worker.generate"]
    assert root.parent is not None and root.parent.span_id == int("cd" * 8, 16)
    assert spans["baton.prefill.chunk"].parent == spans["baton.prefill.compute"].context
    assert spans["baton.prefill.chunk"].attributes == {"baton.chunk_tokens": 16}
    send = spans["baton.kv_transfer.send"]
    assert send.parent is not None and send.parent.span_id == root.context.span_id
    assert send.context.trace_id == int(TRACE, 16)
    assert [link.context.span_id for link in send.links] == [int("ef" * 8, 16)]
    assert send.end_time - send.start_time == pytest.approx(20_000_000, abs=1000)


class _Stub:
    def __init__(self) -> None:
        self.metadata: dict[str, str] = {}

    def Generate(self, request: pb.GenerateRequest, metadata: Any = ()) -> Any:
        self.metadata = dict(metadata)
        return SimpleNamespace(add_done_callback=lambda done: None)


@pytest.mark.parametrize("client", [None, "01", "00"])
def test_the_routers_sampling_decision_reaches_the_workers(client: str | None) -> None:
    """A request the router's sampler leaves out (ratio 0, no client context), or whose
    client context is not sampled, sends no span and tells the workers so (their streams
    then record nothing); a client's sampled context wins over the ratio."""
    tracing, exporter = _in_memory(ratio=0.0)
    headers = {} if client is None else {"traceparent": f"00-{TRACE}-{'cd' * 8}-{client}"}
    trace = RequestTrace.begin(tracing, headers, "/v1/completions", "r1", time.monotonic())
    with trace.admission():
        pass
    worker = SimpleNamespace(
        role=pb.DECODE, worker_id="d0", info=SimpleNamespace(grpc_address="x"), stub=_Stub()
    )
    trace.call(worker, pb.GenerateRequest(request_id="r1", room=7))  # type: ignore[arg-type]
    trace.end(200)
    sampled = client == "01"
    assert bool(int(worker.stub.metadata["traceparent"][-2:], 16) & 1) == sampled
    stream = StreamTrace(
        tracing, _Call(worker.stub.metadata["traceparent"]), pb.GenerateRequest(), "decode"
    )  # type: ignore[arg-type]
    assert (stream.traceparent is not None) == sampled
    names = {s.name for s in exporter.get_finished_spans()}
    assert names == (
        {"POST /v1/completions", "baton.router.prepare", "baton.router.admission"}
        if sampled
        else set()
    )
