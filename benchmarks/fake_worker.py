"""A fake Worker gRPC service: deterministic tokens, no model. The router's tests and
`router_relay` (the router's CPU per streamed token) run real routers against it;
`baton.benchmarks.fake_server` fakes a whole OpenAI server instead.

It "generates" `script` (cycled) from its start, or from `output_offset` for a resumed
request (as a real engine continues the same output), honouring `max_new_tokens`,
`stop_token_ids` (unless `ignore_eos`) and `return_logprob`; optional delays and failure
modes make it slow or broken on demand. Its role shapes the stream as a real worker's:

- BOTH: every token, then the finish.
- PREFILL: one response with the first token (finished if that token ends the request),
  then the stream ends.
- DECODE: tokens 2..n and the finish (the first token is the prefill worker's).

Every request, Abort and unfinished stream is recorded for tests to inspect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_server

ROLE_NAMES = {pb.BOTH: "both", pb.PREFILL: "prefill", pb.DECODE: "decode"}


@dataclass
class FakeBehavior:
    script: Sequence[int] = (10, 11, 12, 13, 14, 15, 16, 17)
    tokens_per_chunk: int = 1
    first_delay: float = 0.0  # seconds before the first response
    delay: float = 0.0  # seconds between responses
    # None, or when to fail: "at_start" (gRPC UNAVAILABLE before any token), "after_first"
    # (UNAVAILABLE after `fail_after` responses), "hang" (silence after `fail_after`
    # responses, as a stopped process), "error_finish" (finish_reason "error").
    fail: str | None = None
    fail_after: int = 1
    timings: pb.Timings = field(default_factory=pb.Timings)
    cached_tokens: int = 0
    busy: bool = False  # FlushCache refuses, as a worker with running requests does


class FakeWorker(pb_grpc.WorkerServicer):
    def __init__(
        self, worker_id: str, role: pb.Role = pb.BOTH, behavior: FakeBehavior | None = None
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.behavior = behavior or FakeBehavior()
        self.requests: list[pb.GenerateRequest] = []
        self.aborted: list[str] = []
        self.unfinished: list[str] = []  # streams that ended early: cancelled or failed
        self.flushes = 0
        self.address = ""
        self._server: grpc.aio.Server | None = None

    async def start(
        self, host: str = "127.0.0.1", cluster_token: str | None = None, port: int = 0
    ) -> str:
        """Serve on `port` (0: a free one); return "host:port"."""
        self._server = make_server(cluster_token)
        pb_grpc.add_WorkerServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{host}:{port}")
        await self._server.start()
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    def info(self, layout: pb.KVLayout | None = None) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            grpc_address=self.address,
            kv_control_address=f"tcp://{self.address}-kv",
            transfer_address=f"{self.address}-transfer",
            transfer_backend="fake",
            layout=layout or pb.KVLayout(model="fake", page_size=1, dtype="float32"),
        )

    # -- the service ------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        behavior = self.behavior
        finished = False
        try:
            if behavior.first_delay:
                await asyncio.sleep(behavior.first_delay)
            if behavior.fail == "at_start":
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is broken")
            if behavior.fail == "error_finish":
                yield pb.GenerateResponse(finish_reason="error", error_message="fake failure")
                finished = True
                return
            for i, response in enumerate(self._responses(request)):
                if i and behavior.delay:
                    await asyncio.sleep(behavior.delay)
                if i >= behavior.fail_after and behavior.fail == "after_first":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} died")
                if i >= behavior.fail_after and behavior.fail == "hang":
                    await asyncio.Event().wait()
                yield response
            finished = True
        finally:
            if not finished:
                self.unfinished.append(request.request_id)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        self.aborted.append(request.request_id)
        return pb.AbortResponse()

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return pb.HealthResponse(ok=True, role=ROLE_NAMES[self.role], status="fake")

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return pb.StatsResponse()

    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushCacheResponse:
        self.flushes += 1
        if self.behavior.busy:
            return pb.FlushCacheResponse(flushed=False, message="requests are running")
        return pb.FlushCacheResponse(flushed=True)

    # -- the script -------------------------------------------------------------------------

    def _tokens(self, request: pb.GenerateRequest) -> tuple[list[int], str]:
        """The whole generation a real engine would produce, and its finish reason."""
        sampling = request.sampling
        stops = set() if sampling.ignore_eos else set(sampling.stop_token_ids)
        script = self.behavior.script
        start = sampling.output_offset
        tokens: list[int] = []
        for i in range(sampling.max_new_tokens):
            tokens.append(script[(start + i) % len(script)])
            if tokens[-1] in stops and i + 1 >= sampling.min_new_tokens:
                return tokens, "stop"
        return tokens, "length"

    def _responses(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        tokens, reason = self._tokens(request)
        if self.role == pb.PREFILL:
            chunks = [tokens[:1]]
            reason = reason if len(tokens) == 1 else ""
        else:
            start = 1 if self.role == pb.DECODE else 0
            size = self.behavior.tokens_per_chunk
            chunks = [tokens[i : i + size] for i in range(start, len(tokens), size)] or [[]]
        responses = [
            pb.GenerateResponse(
                token_ids=chunk,
                logprobs=[self._logprob(t, request) for t in chunk]
                if request.return_logprob
                else [],
                prompt_tokens=len(request.input_ids),
                cached_tokens=self.behavior.cached_tokens,
            )
            for chunk in chunks
        ]
        responses[-1].finish_reason = reason
        responses[-1].completion_tokens = len(tokens)
        responses[-1].timings.CopyFrom(self.behavior.timings)
        return responses

    @staticmethod
    def _logprob(token_id: int, request: pb.GenerateRequest) -> pb.TokenLogprob:
        top = [
            pb.TopLogprob(token_id=token_id + k, logprob=-0.5 - k)
            for k in range(request.top_logprobs)
        ]
        return pb.TokenLogprob(token_id=token_id, logprob=-0.5, top_logprobs=top)


async def start_workers(workers: Sequence[FakeWorker], cluster_token: str | None = None) -> None:
    for worker in workers:
        await worker.start(cluster_token=cluster_token)


async def stop_workers(workers: Sequence[FakeWorker]) -> None:
    for worker in workers:
        with contextlib.suppress(Exception):
            await worker.stop()
