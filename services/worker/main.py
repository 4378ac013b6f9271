"""`baton worker | prefill | decode`: a worker is a gRPC frontend plus a scheduler process.

The frontend starts the scheduler process, waits until it reports ready, serves the
Worker gRPC service and a small HTTP port (/health, /metrics), and registers with the
registry (`--registry`: the bootstrap service or etcd). SIGTERM drains: new requests are
refused, running ones finish, then the worker deregisters and exits. The router's SetRole
call changes its role in place; it then registers again under the new role (the command it
was started as, `baton decode`, and its worker id keep naming the role it started in).

If the scheduler process dies, the worker cannot recover: its open streams end with an
error at once (the router moves them), it deregisters, and it exits with status 1 so that
a supervisor restarts it. Every shutdown step has a deadline; none waits on a peer that is
gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton.common.config import ModelConfig
from baton.common.engine.process import freeze_heap
from baton.common.options import ConfigError
from baton.common.protocol import SwitchRoleOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import bind_address, make_server, token_refusal
from baton.services.httpserve import start_http
from baton.services.registry import config as registry_config
from baton.services.registry.base import Registry
from baton.services.registry.membership import WorkerRegistration
from baton.services.tracing import start_tracing
from baton.services.worker.config import (
    COMMAND_ROLES,
    SchedulerProcArgs,
    WorkerConfig,
    add_worker_options,
    worker_config,
)
from baton.services.worker.frontend import WorkerService
from baton.services.worker.kv_publisher import KVEventPublisher
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.registration import PB_ROLE, register, worker_info
from baton.services.worker.scheduler_link import SchedulerGone, SchedulerLink
from baton.services.worker.spawn import scheduler_main

log = logging.getLogger("baton.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_options(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s"
    )
    try:
        config = worker_config(args, COMMAND_ROLES[args.command])
        refusal = token_refusal(config.cluster_token, config.insecure, "the worker")
        if refusal:
            raise ValueError(refusal)
        if not config.cluster_token:
            log.warning("no cluster token (--insecure): every port of this worker is open")
        ModelConfig.from_pretrained(config.engine.model_path)
        registry = None
        if config.registry is not None:
            registry = registry_config.open_registry(
                config.registry, config.cluster_token, config.lease_ttl
            )
    except ConfigError:
        raise  # the command line names its flag
    except (ValueError, OSError) as e:
        log.error("bad configuration: %s", e)
        return 2
    code = asyncio.run(serve(config, registry))
    # Everything is closed and flushed by now. Skip the interpreter's teardown: collecting
    # torch's objects at exit takes seconds, up to a minute on a busy machine, and a stop
    # must not take longer than its grace period.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def serve(config: WorkerConfig, registry: Registry | None) -> int:
    cfg, role = config.engine, config.role
    model_cfg = ModelConfig.from_pretrained(cfg.model_path)
    ipc_dir = tempfile.mkdtemp(prefix="baton-")
    to_sched, from_sched = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    metrics = WorkerMetrics(role)
    incarnation = uuid.uuid4().hex
    kv_events = None
    if config.kv_events == "on":
        kv_events = KVEventPublisher(incarnation, cfg.page_size, config.kv_events_backlog)
    link = SchedulerLink(to_sched, from_sched, metrics, kv_events)
    proc_args = SchedulerProcArgs(
        cfg,
        to_sched,
        from_sched,
        config.transfer,
        config.log_level.upper(),
        kv_events=kv_events is not None,
    )
    proc = mp.get_context("spawn").Process(
        target=scheduler_main, args=(proc_args,), name="baton-scheduler", daemon=False
    )
    proc.start()
    loop = asyncio.get_running_loop()
    dead: asyncio.Future[None] = loop.create_future()  # the scheduler process ended

    def on_exit() -> None:
        if not dead.done():
            dead.set_result(None)

    loop.add_reader(proc.sentinel, on_exit)
    ready = await _wait_ready(link, dead, proc)
    if ready is None:
        await _stop_scheduler(proc, dead, link, ipc_dir)
        return 1

    worker_id = config.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    tracing = start_tracing(
        f"baton-{role}",
        config.otlp_traces_endpoint,
        config.otlp_traces_sample_ratio,
        metrics.registry,
        "baton_worker",
        instance=worker_id,
    )
    service = WorkerService(
        link, role, model_cfg.vocab_size, metrics, config.stream_interval, tracing
    )
    server = make_server(config.cluster_token)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port(bind_address(config.host, config.port))
    await server.start()
    http_server, http_port = await _start_http(config.host, config.metrics_port, service, metrics)
    advertise = config.advertised
    log.info(
        "worker %s (%s) serving gRPC on %s:%d, metrics on %s:%d",
        worker_id,
        role,
        config.host,
        port,
        config.host,
        http_port,
    )
    print(
        f"BATON_WORKER_READY grpc={advertise}:{port} http={advertise}:{http_port} "
        f"BATON_WORKER_PID={os.getpid()}",
        flush=True,
    )
    freeze_heap()  # ~61k objects once up: a full collection 33 ms, every stream waiting

    registration = watcher = None
    if registry is not None:
        addresses = (f"{advertise}:{port}", f"{advertise}:{http_port}")
        info = worker_info(config, model_cfg, worker_id, addresses, ready, incarnation)
        registration, watcher = await register(registry, info, config, link, metrics)
        service.on_role_changed = _reregister(registration)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    await asyncio.wait([dead, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    scheduler_died = dead.done()
    await _wind_down(scheduler_died, proc, link, service)
    if registration is not None:
        await _bounded(registration.stop(), STEP_TIMEOUT_S, "deregistering")
    if watcher is not None:
        await _bounded(watcher.stop(), STEP_TIMEOUT_S, "stopping the peer watch")
    if registry is not None:
        await _bounded(registry.close(), STEP_TIMEOUT_S, "closing the registry")
    if kv_events is not None:
        kv_events.close()  # its streams never end on their own
    await _bounded(server.stop(grace=STEP_TIMEOUT_S), 2 * STEP_TIMEOUT_S, "stopping gRPC")
    http_server.should_exit = True
    if tracing is not None:
        await _bounded(asyncio.to_thread(tracing.shutdown), STEP_TIMEOUT_S, "sending spans")
    await _stop_scheduler(proc, dead, link, ipc_dir)
    log.info("worker stopped")
    return 1 if scheduler_died else 0


async def _wind_down(
    scheduler_died: bool, proc: Any, link: SchedulerLink, service: WorkerService
) -> None:
    """The scheduler process died: fail the open streams; or a stop was asked: drain."""
    if scheduler_died:
        proc.join(1)  # it has ended (its sentinel closed): this reaps it, for its exit code
        log.error(
            "scheduler process exited unexpectedly (code %s); failing %d open streams, "
            "deregistering and exiting",
            proc.exitcode,
            len(link.streams),
        )
        link.scheduler_lost(f"the worker's scheduler process died (exit code {proc.exitcode})")
    else:
        log.info("draining: refusing new requests, finishing %d running", len(link.streams))
        service.draining = True
        await _bounded(service.idle.wait(), DRAIN_TIMEOUT_S, "draining")


DRAIN_TIMEOUT_S = 60.0  # running requests finish within this on SIGTERM
STEP_TIMEOUT_S = 2.0  # each other shutdown step
SCHEDULER_EXIT_TIMEOUT_S = 10.0


async def _wait_ready(link: SchedulerLink, dead: asyncio.Future[None], proc: Any) -> Any:
    """The scheduler's ReadyOut, or None (logged) if it failed or ended first."""
    either: set[asyncio.Future[Any]] = {link.ready, dead}
    await asyncio.wait(either, timeout=600, return_when=asyncio.FIRST_COMPLETED)
    if not link.ready.done():
        log.error("scheduler process did not start (exit code %s)", proc.exitcode)
        return None
    ready = link.ready.result()
    if ready.error:
        log.error("scheduler process failed: %s", ready.error)
        return None
    return ready


async def _bounded(step: Coroutine[Any, Any, Any], timeout: float, what: str) -> None:
    try:
        await asyncio.wait_for(step, timeout)
    except asyncio.TimeoutError:
        log.warning("%s took more than %.0fs; going on", what, timeout)
    except Exception:
        log.exception("%s failed; going on", what)


async def _stop_scheduler(
    proc: Any, dead: asyncio.Future[None], link: SchedulerLink, ipc_dir: str
) -> None:
    """Ask the scheduler process to stop, kill it if it does not, free the link."""
    from baton.common.protocol import ShutdownReq

    if not dead.done():
        with contextlib.suppress(SchedulerGone):
            await link.send(ShutdownReq())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(dead), SCHEDULER_EXIT_TIMEOUT_S)
    proc.join(1 if dead.done() else 0)  # reap it (its sentinel closes just before it ends)
    if proc.is_alive():
        log.warning("scheduler process did not stop; killing it")
        proc.kill()
        proc.join(5)
    asyncio.get_running_loop().remove_reader(proc.sentinel)
    link.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _reregister(
    registration: WorkerRegistration,
) -> Callable[[SwitchRoleOut], Awaitable[None]]:
    """What the worker does once its scheduler changed role: register again under the new
    role and KV-plane addresses (the same worker id, grpc address and incarnation)."""

    async def republish(out: SwitchRoleOut) -> None:
        info = pb.WorkerInfo()
        info.CopyFrom(registration.info)
        info.role = PB_ROLE[out.role]
        info.kv_control_address = out.kv_control_address
        info.transfer_address = out.transfer_address
        await _bounded(registration.republish(info), STEP_TIMEOUT_S, "registering the new role")

    return republish


async def _start_http(
    host: str, port: int, service: WorkerService, metrics: WorkerMetrics
) -> tuple[Any, int]:
    app = FastAPI(title="baton worker")

    @app.get("/health")
    async def health() -> Response:
        ok = not service.draining
        return Response("ok" if ok else "draining", status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return await start_http(app, host, port)
