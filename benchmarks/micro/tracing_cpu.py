"""The CPU a traced request costs each process of a 1P1D cluster in baton's tracing code,
measured in one process, free of the noise of a shared host (issue 44's 2% target; the
cluster side by side: tracing_overhead.py).

    python -m baton.benchmarks.micro.tracing_cpu --requests 2000 --rounds 3

The router's side of a request (its span, preparation, admission, placement, one call to
P and one to D, their ends), P's stream (its span and stages, a prompt chunk, the KV
transfer's span after the stream) and D's (its span and stages, the transfer's span, 32
tokens), each through the code the processes run, with gRPC calls faked and each side's
own `Tracing` exporting over OTLP/gRPC to a sink in a child process, whose CPU does not
count. The scheduler's records cross as msgpack, as they do over ZMQ. A figure is the
process's CPU time (every thread: the batch processor's encoding and export included) per
request, the least over the rounds; spans are flushed every 80 requests, so the exporter
sends batches of a few hundred as it would under load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from types import SimpleNamespace
from typing import Any

import grpc
import msgspec
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as collector
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as collector_grpc

from baton.common.protocol import SpansOut, TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.state import SpanRecord, SpanValue
from baton.services.otel import Tracing
from baton.services.router import tracing as router_tracing
from baton.services.router.tracing import RequestTrace
from baton.services.worker.tracing import StreamTrace, emit_late

PROMPT, OUTPUT = 128, 32
FLUSH_EVERY = 80  # requests between flushes: batches of a few hundred spans
PROCESSES = ("router", "prefill", "decode")
Metadata = tuple[tuple[str, str], ...]  # a call's gRPC metadata


class _Call:
    """A Generate call that ends at once, with status OK."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.done: Callable[[Any], None] | None = None

    def add_done_callback(self, done: Callable[[Any], None]) -> None:
        self.done = done

    def cancelled(self) -> bool:
        return False

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    async def details(self) -> str:
        return ""


class _Stub:
    def __init__(self) -> None:
        self.last: _Call | None = None

    def Generate(self, request: pb.GenerateRequest, metadata: Any = ()) -> _Call:
        self.last = _Call(tuple(metadata))
        return self.last


class _Context:
    """A worker's view of an incoming call: its metadata."""

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> Metadata:
        return self._metadata


def _worker(role: int, worker_id: str) -> Any:
    info = SimpleNamespace(grpc_address="127.0.0.1:1")
    return SimpleNamespace(role=role, worker_id=worker_id, info=info, stub=_Stub())


_RECORDS = msgspec.msgpack.Decoder(SpansOut)
_ENCODE = msgspec.msgpack.Encoder().encode
PREFILL, DECODE = _worker(pb.PREFILL, "prefill-0"), _worker(pb.DECODE, "decode-0")
PLACEMENT = SimpleNamespace(kind="pd", reason="least loaded")


async def router_side(tracing: Tracing, n: int) -> tuple[Metadata, Metadata]:
    """One request through the router's tracing: the metadata of its calls to P and D."""
    headers = {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"}
    rid = f"cmpl-{n}"
    trace = RequestTrace.begin(tracing, headers, "/v1/completions", rid, time.monotonic())
    with trace.admission():
        pass
    router_tracing.placed(router_tracing.placing(), PLACEMENT, PREFILL, DECODE)  # type: ignore[arg-type]
    request = pb.GenerateRequest(request_id=rid, room=n + 1, input_ids=list(range(PROMPT)))
    calls = []
    for worker in (PREFILL, DECODE):
        router_tracing.generate(worker, request)
        calls.append(worker.stub.last)
    for call in calls:
        call.done(call)
    await asyncio.sleep(0)  # the calls' ends read their status
    trace.end(200)
    return calls[0].metadata, calls[1].metadata


def _records(traceparent: str | None, rid: str, records: list[SpanRecord]) -> list[SpanRecord]:
    """`records` as the scheduler process sends them (msgpack over ZMQ)."""
    assert traceparent is not None
    return _RECORDS.decode(_ENCODE(SpansOut(rid, traceparent, records))).spans


def prefill_side(tracing: Tracing, metadata: Metadata, n: int) -> str:
    """P's stream of one request: its traceparent, for D's link."""
    rid, now = f"cmpl-{n}", time.monotonic()
    request = pb.GenerateRequest(request_id=rid, room=n + 1)
    trace = StreamTrace(tracing, _Context(metadata), request, "prefill")
    chunk: dict[str, SpanValue] = {"baton.chunk_tokens": PROMPT, "baton.prefix_tokens": 0}
    chunk |= {"baton.cached_tokens": 0, "baton.last_chunk": True}
    trace.recorded(
        _records(trace.traceparent, rid, [SpanRecord("baton.prefill.chunk", now, now, chunk)])
    )
    timings = {"queue": 0.001, "prefill": 0.01}
    trace.sent(TokenOut(rid, [5], finished=True, finish_reason="length", timings=timings))
    trace.end()
    assert trace.traceparent is not None
    send = _transfer(n) | {"baton.kv.regions": 1}
    late = SpanRecord("baton.kv_transfer.send", now, now, send, [trace.traceparent])
    emit_late(tracing, SpansOut(rid, trace.traceparent, _records(trace.traceparent, rid, [late])))
    return trace.traceparent


def decode_side(tracing: Tracing, metadata: Metadata, peer: str, n: int) -> None:
    rid, now = f"cmpl-{n}", time.monotonic()
    request = pb.GenerateRequest(request_id=rid, room=n + 1)
    trace = StreamTrace(tracing, _Context(metadata), request, "decode")
    receive = _transfer(n) | {"baton.kv.prefix_pages": 0, "baton.kv.regions": 1}
    record = SpanRecord("baton.kv_transfer.receive", now, now, receive, [peer])
    trace.recorded(_records(trace.traceparent, rid, [record]))
    for _ in range(OUTPUT - 1):
        trace.sent(TokenOut(rid, [7]))
    timings = {"decode_admission": 0.001, "kv_transfer": 0.005}
    trace.sent(TokenOut(rid, [7], finished=True, finish_reason="length", timings=timings))
    trace.end()


def _transfer(n: int) -> dict[str, str | int | float | bool]:
    """A room's transfer attributes, as the roles record them (common/disagg)."""
    return {
        "baton.room": str(n + 1),
        "baton.kv.backend": "ipc",
        "baton.kv.outcome": "ok",
        "baton.kv.pages": 8,
        "baton.kv.bytes": 8 * 4096,
        "baton.kv.peer": "tcp://127.0.0.1:5555",
    }


def measure(requests: int, rounds: int) -> dict[str, Any]:
    """CPU µs per traced request, by process (the least over `rounds`), and the spans the
    sink received per request."""
    sink = subprocess.Popen(
        [sys.executable, "-m", "baton.benchmarks.micro.tracing_cpu", "--sink"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None and sink.stdin is not None
        endpoint = sink.stdout.readline().strip()
        tracings = {p: Tracing.start(f"baton-{p}", endpoint, 1.0, instance=p) for p in PROCESSES}
        best = dict.fromkeys(PROCESSES, float("inf"))
        for _ in range(rounds):
            for process, seconds in _round(tracings, requests).items():
                best[process] = min(best[process], seconds / requests * 1e6)
        for tracing in tracings.values():
            tracing.shutdown()
        sink.stdin.close()
        spans = int(sink.stdout.readline())
    finally:
        sink.kill()
        sink.wait()
    return {
        "cpu_us_per_request": best | {"total": sum(best.values())},
        "spans_per_request": spans / (requests * rounds),
        "requests": requests,
        "rounds": rounds,
    }


def _round(tracings: dict[str, Tracing], requests: int) -> dict[str, float]:
    """Each process's CPU seconds for `requests` requests, one process after the other."""
    out: dict[str, float] = {}

    async def routed() -> list[tuple[Metadata, Metadata]]:
        calls = []
        for n in range(requests):
            calls.append(await router_side(tracings["router"], n))
            _flush(tracings["router"], n)
        return calls

    began = time.process_time()
    calls = asyncio.run(routed())
    tracings["router"].processor.force_flush()
    out["router"] = time.process_time() - began
    began = time.process_time()
    peers = []
    for n, (to_prefill, _) in enumerate(calls):
        peers.append(prefill_side(tracings["prefill"], to_prefill, n))
        _flush(tracings["prefill"], n)
    tracings["prefill"].processor.force_flush()
    out["prefill"] = time.process_time() - began
    began = time.process_time()
    for n, ((_, to_decode), peer) in enumerate(zip(calls, peers, strict=True)):
        decode_side(tracings["decode"], to_decode, peer, n)
        _flush(tracings["decode"], n)
    tracings["decode"].processor.force_flush()
    out["decode"] = time.process_time() - began
    return out


def _flush(tracing: Tracing, n: int) -> None:
    if n % FLUSH_EVERY == FLUSH_EVERY - 1:
        tracing.processor.force_flush()


class SpanSink(collector_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector that counts the spans it is sent and keeps none."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        collector_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.endpoint = f"http://127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def Export(
        self, request: collector.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> collector.ExportTraceServiceResponse:
        n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        with self._lock:
            self.spans += n
        return collector.ExportTraceServiceResponse()

    def stop(self) -> None:
        self._server.stop(grace=None)


def serve_sink() -> None:
    """An OTLP/gRPC sink: prints its endpoint, then, once stdin closes, the spans it got."""
    sink = SpanSink()
    print(sink.endpoint, flush=True)
    sys.stdin.read()
    print(sink.spans, flush=True)
    sink.stop()


def report(result: dict[str, Any]) -> str:
    cpu = result["cpu_us_per_request"]
    figures = "  ".join(f"{name} {cpu[name]:.0f}" for name in (*PROCESSES, "total"))
    return (
        f"CPU µs per traced request, in-process (least of {result['rounds']} rounds of "
        f"{result['requests']}): {figures}; {result['spans_per_request']:.1f} spans a request"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sink:
        serve_sink()
        return
    print(report(measure(args.requests, args.rounds)))


if __name__ == "__main__":
    main()
