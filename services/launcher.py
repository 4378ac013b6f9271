"""`baton up`: a whole cluster on this machine — bootstrap, router, and workers.

With `--registry etcd://...` the workers register in that etcd cluster and no bootstrap is
started.

Defaults to one prefill and one decode worker (`--prefill N --decode M`); `--workers K`
starts K aggregated workers instead. It generates a cluster token, waits until the
router reports healthy, prints the URL, and on Ctrl-C or SIGTERM stops every process it
started (workers drain first), so no process is orphaned and every port is freed.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from baton.services.registry import config as registry_config

log = logging.getLogger("baton.up")

# worker flags `baton up` passes through unchanged: (flag, takes a value)
_WORKER_PASSTHROUGH = [
    ("--model", True),
    ("--dtype", True),
    ("--device", True),
    ("--load-format", True),
    ("--page-size", True),
    ("--max-total-tokens", True),
    ("--max-running-requests", True),
    ("--chunked-prefill-size", True),
    ("--attention-backend", True),
    ("--transfer-backend", True),
    ("--schedule-policy", True),
    ("--disable-radix-cache", False),
    ("--disable-overlap", False),
    ("--enable-mixed-chunk", False),
    ("--decode-radix-cache", False),
    ("--kv-verify-checksum", False),
    ("--transfer-fault", True),
    ("--room-timeout", True),
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster shape")
    g.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    g.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="aggregated workers instead of prefill/decode (the baseline)",
    )
    g = parser.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1", help="address every process binds")
    g.add_argument("--port", type=int, default=8000, help="router HTTP port")
    g.add_argument(
        "--bootstrap-port", type=int, default=0, help="built-in bootstrap's port (0 = free port)"
    )
    g = registry_config.add_arguments(parser)
    g.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="seconds a worker stays routable without a heartbeat",
    )
    g = parser.add_argument_group("routing")
    g.add_argument("--policy", default="cache_aware")
    g.add_argument("--prefill-policy", default="cache_aware")
    g.add_argument("--decode-policy", default="power_of_two")
    g = parser.add_argument_group("security")
    g.add_argument("--api-key", default=None)
    g.add_argument("--cluster-token", default=None, help="default: a fresh random token")
    g = parser.add_argument_group("worker options (passed to every worker)")
    for flag, takes_value in _WORKER_PASSTHROUGH:
        if takes_value:
            g.add_argument(flag, default=None)
        else:
            g.add_argument(flag, action="store_true")
    g.add_argument(
        "--gpus",
        default=None,
        help="GPU ids to spread workers over, e.g. 0,1,2,3: worker i computes on its share "
        "(--tp GPUs each, listed first in its CUDA_VISIBLE_DEVICES; the others follow so "
        "KV pages can move GPU to GPU)",
    )
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every worker")
    g.add_argument("--prefill-tp", type=int, default=None, help="TP size of prefill workers")
    g.add_argument("--decode-tp", type=int, default=None, help="TP size of decode workers")
    g = parser.add_argument_group("operation")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument("--log-dir", default=None, help="write each process's log here")
    g.add_argument("--log-level", default="INFO")


@dataclass
class Cluster:
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    log_dir: str | None = None

    def start(self, name: str, argv: list[str], gpus: str | None = None) -> None:
        cmd = [sys.executable, "-m", "baton.services.cli", *argv]
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            stdout=out or subprocess.DEVNULL,
            stderr=out or None,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self.procs.append((name, proc))
        log.info("started %s (pid %d)", name, proc.pid)

    def dead(self, names: tuple[str, ...] = ()) -> list[str]:
        return [
            f"{n} (exit {p.returncode})"
            for n, p in self.procs
            if p.poll() is not None and (not names or n in names)
        ]

    def stop(self, grace: float = 15.0) -> None:
        # workers first (they drain and deregister), then router and bootstrap
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", name, grace)
                proc.kill()
                proc.wait()


def worker_argv(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for flag, takes_value in _WORKER_PASSTHROUGH:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if takes_value and value is not None:
            out += [flag, str(value)]
        elif not takes_value and value:
            out.append(flag)
    return out


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s up: %(message)s"
    )
    if args.workers is not None and (args.prefill is not None or args.decode is not None):
        log.error("use either --workers (aggregated) or --prefill/--decode (disaggregated)")
        return 2
    aggregated = args.workers is not None
    n_prefill = 0 if aggregated else (args.prefill if args.prefill is not None else 1)
    n_decode = 0 if aggregated else (args.decode if args.decode is not None else 1)
    if (aggregated and args.workers < 1) or (not aggregated and (n_prefill < 1 or n_decode < 1)):
        log.error("a cluster needs at least one worker of each kind it uses")
        return 2
    if args.model is None:
        from baton.common.models.tiny import default_model_path

        args.model = str(default_model_path())
    try:
        external = registry_config.config_from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if external is not None and args.bootstrap_port:
        log.error("--bootstrap-port is for the built-in bootstrap; --registry replaces it")
        return 2
    token = args.cluster_token or secrets.token_hex(16)
    os.environ["BATON_CLUSTER_TOKEN"] = token  # children read it; it stays off the ps line
    host = args.host
    boot_port = args.bootstrap_port or free_port(host)
    registry = external or registry_config.RegistryConfig(f"{host}:{boot_port}")
    registry_argv = registry_config.passthrough_argv(registry)
    cluster = Cluster(log_dir=args.log_dir)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common = ["--host", host, "--log-level", args.log_level.lower()]
    try:
        if external is None:
            cluster.start(
                "bootstrap",
                [
                    "bootstrap",
                    "--port",
                    str(boot_port),
                    "--lease-ttl",
                    str(args.lease_ttl),
                    *common,
                ],
            )
        heartbeat = str(max(0.1, min(1.0, args.lease_ttl / 4)))
        wargs = [
            *worker_argv(args),
            *registry_argv,
            "--heartbeat-interval",
            heartbeat,
            "--lease-ttl",
            str(args.lease_ttl),
            *common,
        ]
        tp_of = {
            "worker": args.tp,
            "prefill": args.prefill_tp or args.tp,
            "decode": args.decode_tp or args.tp,
        }
        roles = (
            [("worker", f"worker-{i}") for i in range(args.workers or 0)]
            + [("prefill", f"prefill-{i}") for i in range(n_prefill)]
            + [("decode", f"decode-{i}") for i in range(n_decode)]
        )
        gpu_ids = args.gpus.split(",") if args.gpus else []
        next_gpu = 0
        for role, name in roles:
            tp = tp_of[role]
            share = None
            if gpu_ids:
                own = [gpu_ids[(next_gpu + k) % len(gpu_ids)] for k in range(tp)]
                # its own GPUs first (cuda:0..tp-1), the others after: a prefill worker can
                # then write into a decode worker's pool on another GPU (ipc, NVLink)
                share = ",".join(own + [g for g in gpu_ids if g not in own])
                next_gpu += tp
            cluster.start(name, [role, *wargs, "--tp", str(tp)], share)
        router = [
            "router",
            "--port",
            str(args.port),
            *registry_argv,
            "--model",
            args.model,
            "--policy",
            args.policy,
            "--prefill-policy",
            args.prefill_policy,
            "--decode-policy",
            args.decode_policy,
            *common,
        ]
        if args.api_key:
            router += ["--api-key", args.api_key]
        cluster.start("router", router)
        url = f"http://{host}:{args.port}"
        if not _wait_healthy(url, cluster, args.startup_timeout, lambda: stopping):
            return 1
        shape = (
            f"{args.workers} aggregated worker(s)"
            if aggregated
            else f"{n_prefill} prefill + {n_decode} decode"
        )
        print(f"baton is up: {url}/v1  ({shape}; model {args.model})", flush=True)
        reported: set[str] = set()
        while not stopping:
            dead = cluster.dead(("bootstrap", "router"))  # etcd is the operator's to restart
            if dead:
                log.error("%s exited; stopping the cluster", ", ".join(dead))
                return 1
            for gone in set(cluster.dead()) - reported:  # workers: route around them
                log.error("%s exited; the router keeps serving with the others", gone)
                reported.add(gone)
            time.sleep(0.2)
        return 0
    finally:
        log.info("stopping the cluster")
        cluster.stop()


def _wait_healthy(url: str, cluster: Cluster, timeout: float, stopping) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping():
        dead = cluster.dead()
        if dead:
            log.error("failed to start: %s exited", ", ".join(dead))
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    if not stopping():
        log.error("the router did not become healthy within %.0fs", timeout)
    return False
