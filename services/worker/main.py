"""`baton worker | prefill | decode`: a worker is a gRPC frontend plus a scheduler process.

The frontend starts the scheduler process, waits until it reports ready, serves the
Worker gRPC service and a small HTTP port (/health, /metrics), and registers with the
registry (`--registry`: the bootstrap service or etcd). SIGTERM drains: new requests are
refused, running ones finish, then the worker deregisters and exits.
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
import tempfile
import uuid
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton.common.config import ModelConfig
from baton.common.options import ConfigError
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import bind_address, make_server
from baton.common.rpc.convert import load_to_proto
from baton.services.httpserve import start_http
from baton.services.registry import config as registry_config
from baton.services.registry.base import Registry
from baton.services.registry.membership import MembershipWatcher, WorkerRegistration
from baton.services.worker.config import (
    COMMAND_ROLES,
    WorkerConfig,
    add_worker_options,
    worker_config,
)
from baton.services.worker.frontend import SchedulerLink, WorkerService
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.scheduler_proc import SchedulerProcArgs
from baton.services.worker.scheduler_proc import run as run_scheduler

log = logging.getLogger("baton.worker")

_PB_ROLE = {"both": pb.Role.BOTH, "prefill": pb.Role.PREFILL, "decode": pb.Role.DECODE}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_options(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s"
    )
    try:
        config = worker_config(args, COMMAND_ROLES[args.command])
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
    return asyncio.run(serve(config, registry))


async def serve(config: WorkerConfig, registry: Registry | None) -> int:
    cfg, role = config.engine, config.role
    model_cfg = ModelConfig.from_pretrained(cfg.model_path)
    ipc_dir = tempfile.mkdtemp(prefix="baton-")
    to_sched, from_sched = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    metrics = WorkerMetrics(role)
    link = SchedulerLink(to_sched, from_sched, metrics)
    proc_args = SchedulerProcArgs(
        cfg, to_sched, from_sched, config.transfer, config.log_level.upper()
    )
    proc = mp.get_context("spawn").Process(
        target=run_scheduler, args=(proc_args,), name="baton-scheduler", daemon=False
    )
    proc.start()
    try:
        ready = await asyncio.wait_for(link.ready, timeout=600)
    except asyncio.TimeoutError:
        log.error("scheduler process did not start")
        proc.kill()
        return 1
    if ready.error:
        log.error("scheduler process failed: %s", ready.error)
        proc.join(5)
        return 1

    service = WorkerService(link, role, model_cfg.vocab_size, metrics)
    server = make_server(config.cluster_token)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port(bind_address(config.host, config.port))
    await server.start()
    http_server, http_port = await _start_http(config.host, config.metrics_port, service, metrics)
    advertise = config.advertised
    worker_id = config.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
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

    registration = watcher = None
    if registry is not None:
        info = pb.WorkerInfo(
            worker_id=worker_id,
            role=_PB_ROLE[role],
            grpc_address=f"{advertise}:{port}",
            http_address=f"{advertise}:{http_port}",
            kv_control_address=ready.kv_control_address,
            transfer_address=ready.transfer_address,
            transfer_backend=config.transfer.backend,
            layout=pb.KVLayout(
                model=os.path.basename(os.path.normpath(cfg.model_path)),
                page_size=cfg.page_size,
                dtype=cfg.dtype,
                num_layers=model_cfg.num_layers,
                num_kv_heads=model_cfg.num_kv_heads,
                head_dim=model_cfg.head_dim,
                tp_size=cfg.tp_size,
            ),
        )

        def load() -> pb.Load:
            s = link.stats
            if s is None:
                return pb.Load()
            return load_to_proto(s)

        registration = WorkerRegistration(registry, info, config.heartbeat_interval, load)
        await registration.start()
        metrics.registry_registered.set_function(lambda: float(registration.registered))
        if role != "both":
            watcher = _watch_peers(registry, link)
            await watcher.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dead = asyncio.create_task(asyncio.to_thread(proc.join))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([dead, stopper], return_when=asyncio.FIRST_COMPLETED)
    if dead.done():
        log.error("scheduler process exited unexpectedly (code %s)", proc.exitcode)
    else:
        log.info("draining: refusing new requests, finishing %d running", len(link.streams))
        service.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(service.idle.wait(), timeout=60)
    if watcher is not None:
        await watcher.stop()
    if registration is not None:
        await registration.stop()
    if registry is not None:
        await registry.close()
    await server.stop(grace=2)
    http_server.should_exit = True
    from baton.common.protocol import ShutdownReq

    with contextlib.suppress(Exception):
        await link.send(ShutdownReq())
    await asyncio.to_thread(proc.join, 10)
    if proc.is_alive():
        proc.kill()
    link.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)
    stopper.cancel()
    log.info("worker stopped")
    return 0 if not dead.done() else 1


def _watch_peers(registry: Registry, link: SchedulerLink) -> MembershipWatcher:
    """Tell the scheduler when a peer's lease lapses, so rooms bound to it fail at once."""
    from baton.common.protocol import PeerLostReq

    def on_change(event: pb.MembershipEvent) -> None:
        if event.type == pb.MembershipEvent.Type.REMOVED and event.worker.kv_control_address:
            task = asyncio.create_task(link.send(PeerLostReq(event.worker.kv_control_address)))
            _peer_tasks.add(task)
            task.add_done_callback(_peer_tasks.discard)

    return MembershipWatcher(registry, on_change)


_peer_tasks: set[asyncio.Task[None]] = set()


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
