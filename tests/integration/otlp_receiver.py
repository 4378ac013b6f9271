"""An OTLP/gRPC trace receiver for tests: the collector's TraceService, keeping every span
it is sent (from opentelemetry-proto, the protocol a real collector speaks)."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as collector
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as collector_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    instance: str  # its service.instance.id ("" without one)
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    events: tuple[str, ...]
    status_code: int  # 2: error
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each linked span


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind else None


class OTLPReceiver(collector_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        collector_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    def Export(
        self, request: collector.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> collector.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            instance=str(resource.get("service.instance.id", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=tuple(e.name for e in s.events),
                            status_code=s.status.code,
                            links=tuple((k.trace_id.hex(), k.span_id.hex()) for k in s.links),
                        )
                    )
        with self._lock:
            self._spans += received
        return collector.ExportTraceServiceResponse()

    def spans(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float) -> list[ReceivedSpan]:
        """The trace's spans once every name in `names` arrived (or whatever came by then)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def stop(self) -> None:
        self._server.stop(grace=None)
