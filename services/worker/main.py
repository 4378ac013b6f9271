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
import dataclasses
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

from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import bind_address, make_server
from baton.services.httpserve import start_http
from baton.services.registry import config as registry_config
from baton.services.registry.base import Registry
from baton.services.registry.membership import MembershipWatcher, WorkerRegistration
from baton.services.worker.frontend import SchedulerLink, WorkerService
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.scheduler_proc import SchedulerProcArgs
from baton.services.worker.scheduler_proc import run as run_scheduler

log = logging.getLogger("baton.worker")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_ROLE_OF_COMMAND = {"worker": "both", "prefill": "prefill", "decode": "decode"}
_PB_ROLE = {"both": pb.Role.BOTH, "prefill": pb.Role.PREFILL, "decode": pb.Role.DECODE}


def _opt_int(value: str) -> int | None:
    return None if value.lower() in ("", "none", "0") else int(value)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags, grouped by topic; defaults come from EngineConfig."""
    d = _DEFAULTS
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF model folder (default: built-in tiny model)")
    g.add_argument("--dtype", default=d["dtype"], choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d["device"], help="cpu, cuda, cuda:N")
    g.add_argument("--load-format", default=d["load_format"], choices=["safetensors", "dummy"])
    g.add_argument("--seed", type=int, default=d["seed"])
    g = parser.add_argument_group("memory")
    g.add_argument("--page-size", type=int, default=d["page_size"], help="tokens per KV page")
    g.add_argument(
        "--max-total-tokens",
        type=int,
        default=d["max_total_tokens"],
        help="KV pool capacity in tokens",
    )
    g.add_argument("--max-running-requests", type=int, default=d["max_running_requests"])
    g.add_argument("--disable-radix-cache", action="store_true")
    g = parser.add_argument_group("scheduling")
    g.add_argument(
        "--chunked-prefill-size",
        type=_opt_int,
        default=d["chunked_prefill_size"],
        help="per-step prefill token budget (none = no chunking)",
    )
    g.add_argument("--enable-mixed-chunk", action="store_true")
    g.add_argument("--disable-overlap", action="store_true")
    g.add_argument("--schedule-policy", default=d["schedule_policy"], choices=["fcfs", "lpm"])
    g = parser.add_argument_group("attention")
    g.add_argument(
        "--attention-backend",
        default=d["attention_backend"],
        choices=["torch", "triton", "flashinfer"],
    )
    g.add_argument("--prefill-attention-backend", default=None)
    g.add_argument("--decode-attention-backend", default=None)
    g.add_argument("--disable-cuda-graph", action="store_true")


def engine_config(args: argparse.Namespace, role: str) -> EngineConfig:
    model = args.model
    if model is None:
        from baton.common.models.tiny import default_model_path

        model = str(default_model_path())
    return EngineConfig(
        model_path=model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        disable_radix_cache=args.disable_radix_cache
        or (role == "decode" and not getattr(args, "decode_radix_cache", False)),
        chunked_prefill_size=args.chunked_prefill_size,
        enable_mixed_chunk=args.enable_mixed_chunk,
        disable_overlap=args.disable_overlap,
        schedule_policy=args.schedule_policy,
        attention_backend=args.attention_backend,
        prefill_attention_backend=args.prefill_attention_backend,
        decode_attention_backend=args.decode_attention_backend,
        disable_cuda_graph=args.disable_cuda_graph or args.device == "cpu",
        role=role,  # type: ignore[arg-type]
        tp_size=getattr(args, "tp", 1),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument(
        "--advertise-host",
        default=None,
        help="address peers use to reach this worker (default: --host)",
    )
    g.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    g.add_argument("--metrics-port", type=int, default=0, help="HTTP /health + /metrics port")
    g.add_argument("--worker-id", default=None)
    g = registry_config.add_arguments(parser)
    g.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds between lease renewals (at most a third of the lease ttl)",
    )
    g.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="etcd: seconds this worker stays registered without renewing its lease "
        "(the bootstrap service grants its own)",
    )
    g = parser.add_argument_group("disaggregation")
    g.add_argument(
        "--transfer-backend", default="auto", choices=["auto", "ipc", "tcp", "ucx", "fake"]
    )
    g.add_argument(
        "--decode-radix-cache",
        action="store_true",
        help="decode reuses prefixes from its own radix cache",
    )
    g.add_argument(
        "--kv-verify-checksum",
        action="store_true",
        help="debug: checksum every transferred run and verify it on receipt",
    )
    g.add_argument("--transfer-fault", default=None, help="fake backend fault plan (tests)")
    g.add_argument(
        "--kv-control-port", type=int, default=0, help="KV-control (ZMQ) port; 0 = any free port"
    )
    g.add_argument(
        "--room-timeout", type=float, default=30.0, help="seconds a room may stay in one state"
    )
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g = parser.add_argument_group("security")
    g.add_argument("--cluster-token", default=None, help="required from every gRPC caller")
    g = parser.add_argument_group("logging")
    g.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s"
    )
    role = _ROLE_OF_COMMAND[args.command]
    try:
        cfg = engine_config(args, role)
        transfer_config(args)
        ModelConfig.from_pretrained(cfg.model_path)
        if args.lease_ttl <= 0 or args.heartbeat_interval <= 0:
            raise ValueError("--lease-ttl and --heartbeat-interval must be > 0")
        registry_cfg = registry_config.config_from_args(args)
        registry = None
        if registry_cfg is not None:
            registry = registry_config.open_registry(
                registry_cfg, args.cluster_token, args.lease_ttl
            )
    except (ValueError, OSError) as e:
        log.error("bad configuration: %s", e)
        return 2
    return asyncio.run(serve(args, cfg, registry))


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        backend=args.transfer_backend,
        host=args.host,
        advertise_host=args.advertise_host or args.host,
        kv_control_port=args.kv_control_port,
        cluster_token=args.cluster_token,
        verify_checksum=args.kv_verify_checksum,
        room_timeout=args.room_timeout,
        fault=args.transfer_fault,
    )


async def serve(args: argparse.Namespace, cfg: EngineConfig, registry: Registry | None) -> int:
    role = cfg.role
    model_cfg = ModelConfig.from_pretrained(cfg.model_path)
    ipc_dir = tempfile.mkdtemp(prefix="baton-")
    to_sched, from_sched = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    metrics = WorkerMetrics(role)
    link = SchedulerLink(to_sched, from_sched, metrics)
    proc_args = SchedulerProcArgs(
        cfg, to_sched, from_sched, transfer_config(args), args.log_level.upper()
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
    server = make_server(args.cluster_token)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port(bind_address(args.host, args.port))
    await server.start()
    http_server, http_port = await _start_http(args.host, args.metrics_port, service, metrics)
    advertise = args.advertise_host or args.host
    worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    log.info(
        "worker %s (%s) serving gRPC on %s:%d, metrics on %s:%d",
        worker_id,
        role,
        args.host,
        port,
        args.host,
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
            transfer_backend=args.transfer_backend,
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
            return pb.Load(running=s.running, queued=s.queued, token_usage=s.token_usage)

        registration = WorkerRegistration(registry, info, args.heartbeat_interval, load)
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
