"""The router's FastAPI application: `create_app(config, static_workers=None)`.

Workers come from the registry's watch (`config.registry`: the bootstrap service or etcd),
or from `static_workers` (tests, or a fixed cluster); with both, the static ones are added
first and the registry's view follows. While the registry is unreachable the router keeps
routing to the last members it knew, and says so in /health and /metrics. gRPC channels and
the watcher live on the event loop that serves the app, so they are made in its lifespan:
run the app under a server (or `app.router.lifespan_context(app)` in tests). `tokenizer`
reuses one already loaded (tests); by default it is loaded from the model folder.
`app.state.pool` is the `WorkerPool`, `app.state.model` the `ModelInfo`, `app.state.kv_index`
the exact prefix index from the workers' KV events (None with `--kv-events off`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.registry.config import open_registry
from baton.services.registry.watcher import MembershipWatcher
from baton.services.router.admin_migrate import add_migration_routes
from baton.services.router.admission import Admission, derived_limit
from baton.services.router.auth import bearer_matches
from baton.services.router.config import ModelInfo, RouterConfig
from baton.services.router.dispatch import Dispatcher
from baton.services.router.errors import install_error_handlers, unauthorized
from baton.services.router.formats import ChatFormat, CompletionFormat
from baton.services.router.health import Expected, add_health_route
from baton.services.router.kv_index import KVIndex
from baton.services.router.kv_subscriber import KVSubscriber
from baton.services.router.limits import BodyLimitMiddleware
from baton.services.router.metrics import CONTENT_TYPE, RouterMetrics
from baton.services.router.pairing import WorkerChoice
from baton.services.router.params import RequestPreparer
from baton.services.router.placement import Slo
from baton.services.router.policies import make_policy
from baton.services.router.roles import RoleChanger, add_role_routes
from baton.services.router.schemas import ChatCompletionRequest, CompletionRequest
from baton.services.router.serving import Server
from baton.services.router.sglang_routes import add_sglang_routes
from baton.services.router.tool_parsers import make_parser
from baton.services.router.utility import add_utility_routes
from baton.services.router.workers import ROLE_NAMES, WorkerPool
from baton.services.tracing import start_tracing

log = logging.getLogger(__name__)

# Endpoints that need the API key (when one is set), and /metrics unless --metrics-public.
# /health, /health_generate and /version stay open for load balancers; /flush_cache has its
# own admin key.
_PROTECTED_PREFIXES = (
    "/v1/",
    "/generate",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/openapi.json",  # the API's shape is the API's business
    "/docs",
    "/redoc",
)
_METRIC_ENDPOINTS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/model_info",
        "/get_model_info",
        "/server_info",
        "/get_server_info",
        "/health_generate",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/flush_cache",
        "/admin/workers",
        "/health",
        "/metrics",
    }
)


def create_app(
    config: RouterConfig,
    static_workers: Sequence[pb.WorkerInfo] = (),
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    model_path = config.model_path()
    model = ModelInfo.load(model_path, config.served_model_name)
    cluster_id = config.cluster_id or secrets.token_hex(4)  # in /health: which router this is
    tokenizer = tokenizer or Tokenizer.load(model_path)
    pool = WorkerPool(config.cluster_token)
    registry = open_registry(config.registry, config.cluster_token) if config.registry else None
    watcher: MembershipWatcher | None = None
    metrics = RouterMetrics(
        pool.counts_by_role,
        model.name,
        lambda: watcher.connected if watcher else None,
        vllm_names=config.vllm_metrics,
    )
    kv_index = kv_subscriber = None
    if config.kv_events == "on":
        kv_index = KVIndex(config.kv_events_max_lag, metrics=metrics)
        kv_subscriber = KVSubscriber(pool, kv_index)
        metrics.watch_kv_index(kv_index.sizes, kv_index.host_sizes)
    dispatcher = Dispatcher(
        WorkerChoice(
            pool,
            make_policy(config.policy, exact=kv_index),
            make_policy(config.prefill_policy, exact=kv_index),
            make_policy(config.decode_policy, exact=kv_index),
            metrics,
            config.placement,
            Slo(config.ttft_slo, config.tpot_slo),
            kv_index,
        )
    )
    admission = Admission(
        _fixed(config.max_concurrent_requests)
        if config.max_concurrent_requests
        else derived_limit(lambda: pool.capacity),
        config.max_queued_requests,
        config.queue_timeout,
    )
    pool.on_joined(admission.wake)
    pool.on_lapse_ended(lambda outcome: metrics.worker_lapses.labels(outcome).inc())
    metrics.watch_admission(admission)
    tracing = start_tracing(
        "baton-router",
        config.otlp_traces_endpoint,
        config.otlp_traces_sample_ratio,
        metrics.registry,
        "baton_router",
    )
    server = Server(dispatcher, tokenizer, metrics, admission, config.timeout, tracing)
    preparer = RequestPreparer(
        model, tokenizer, make_parser(config.tool_call_parser, tokenizer.vocabulary())
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal watcher
        if kv_subscriber is not None:
            kv_subscriber.start()
        for info in static_workers:
            pool.upsert(info)
        if registry is not None:
            watcher = MembershipWatcher(registry, pool.apply)
            await watcher.start()
        try:
            yield
        finally:
            if watcher is not None:
                await watcher.stop()
            if registry is not None:
                await registry.close()
            if kv_subscriber is not None:
                await kv_subscriber.close()
            await dispatcher.close()
            await pool.close()
            if tracing is not None:
                await run_in_threadpool(tracing.shutdown)  # sends the spans still batched

    app = FastAPI(title="baton router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pool = pool
    app.state.kv_index = kv_index
    app.state.model = model
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, read_timeout=config.body_timeout
    )
    app.add_middleware(
        _ApiKeyMiddleware, api_key=config.api_key, metrics_public=config.metrics_public
    )
    app.add_middleware(_RequestMetricsMiddleware, metrics=metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        prepared = await run_in_threadpool(preparer.completion, body)  # tokenizes
        fmt = CompletionFormat(model.name, tokenizer, prepared)
        return await server.serve(request, "/v1/completions", prepared, fmt, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        prepared = await run_in_threadpool(preparer.chat, body)
        fmt = ChatFormat(model.name, tokenizer, prepared)
        return await server.serve(request, "/v1/chat/completions", prepared, fmt, arrival)

    add_sglang_routes(app, server, preparer, pool, admission)
    add_utility_routes(app, preparer, pool, config.admin_api_key)
    expected = Expected(config.expect_workers)
    changer = RoleChanger(pool, dispatcher, metrics, expected.role_changed)
    add_role_routes(app, changer, config.admin_api_key)
    add_migration_routes(app, dispatcher, config.admin_api_key)
    add_health_route(app, cluster_id, pool, expected, changer.under_way, lambda: watcher)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        workers = [
            (w.worker_id, ROLE_NAMES.get(w.role, "unknown"), w.info.http_address)
            for role in (pb.BOTH, pb.PREFILL, pb.DECODE)
            for w in pool.workers(role)
        ]
        return Response(await metrics.render_cluster(workers), media_type=CONTENT_TYPE)

    return app


def _fixed(limit: int) -> Callable[[], int]:
    return lambda: limit


class _ApiKeyMiddleware:
    """401 for protected endpoints without `Authorization: Bearer <api_key>`, before the
    body is read (a malformed body from an unauthenticated client is still a 401)."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics_public: bool) -> None:
        self._app = app
        self._expected = api_key.encode() if api_key else None
        self._prefixes = _PROTECTED_PREFIXES + (() if metrics_public else ("/metrics",))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self._expected is not None
            and scope["type"] == "http"
            and scope["path"].startswith(self._prefixes)
        ):
            presented = dict(scope["headers"]).get(b"authorization", b"")
            if not bearer_matches(presented, self._expected):
                await unauthorized().response()(scope, receive, send)
                return
        await self._app(scope, receive, send)


class _RequestMetricsMiddleware:
    """Counts every answered request by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, send_noting_status)
        finally:
            path = scope["path"]
            endpoint = path if path in _METRIC_ENDPOINTS else "other"
            self._metrics.requests.labels(self._metrics.model_name, endpoint, str(status)).inc()
