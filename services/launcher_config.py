"""What `baton up` starts, checked before it starts anything.

`plan_cluster` builds and validates every process's config from `baton up`'s flags (declared
in `launcher_options`), then turns each back into that process's command line
(`config_argv`): a value any process would refuse stops `baton up` before the first process
starts. `ports_in_use` checks the ports the cluster would listen on.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import socket
from collections import Counter
from dataclasses import dataclass

from baton.common.config import ModelConfig
from baton.common.env import CUDA_VISIBLE_DEVICES
from baton.common.models.builtin import builtin_model_dir
from baton.common.options import ConfigError, config_argv, option_values
from baton.common.rpc.auth import short_token_refusal
from baton.services.bootstrap.config import BootstrapConfig
from baton.services.launcher_options import ROUTER_OPTIONS, LauncherConfig
from baton.services.registry import config as registry_config
from baton.services.registry.config import RegistryConfig
from baton.services.router.config import RouterConfig
from baton.services.worker.config import COMMAND_ROLES, WorkerConfig, worker_config


@dataclass(frozen=True)
class Process:
    name: str
    argv: list[str]  # after `baton`
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES
    worker_id: str | None = None  # a worker's name in the registry (and the router's /health)


@dataclass(frozen=True)
class ClusterPlan:
    up: LauncherConfig
    model: str
    router: RouterConfig
    # in start order: bootstrap (if built in), workers, router; the planner once it is up
    processes: list[Process]
    env: dict[str, str]  # secrets every child reads from its environment

    @property
    def url(self) -> str:
        return f"http://{self.up.host}:{self.router.port}"

    @property
    def workers(self) -> dict[str, str]:
        """Process name of each worker, by its worker id."""
        return {p.worker_id: p.name for p in self.processes if p.worker_id is not None}


def validate(args: argparse.Namespace) -> tuple[LauncherConfig, RegistryConfig | None]:
    """Every config `baton up` would start, built once without a model or a port, so a bad
    value of any flag stops it here. Raises ConfigError (names the flag) or ValueError."""
    up = LauncherConfig(**option_values(LauncherConfig, args))
    if refusal := short_token_refusal(up.cluster_token, "--cluster-token"):
        raise ValueError(refusal)  # not a ConfigError, which would show the token
    external = registry_config.config_from_args(args)
    companions = registry_config.passthrough_argv(_given_registry(args))[2::2]
    if external is None and companions:  # alone, it would be ignored
        raise ValueError(f"{companions[0]} needs --registry (an etcd cluster)")
    if external is not None and up.bootstrap_port:
        raise ConfigError(
            up, "bootstrap_port", "is for the built-in bootstrap; --registry replaces it"
        )
    _router_config(args, up, "", external, None)
    BootstrapConfig(host=up.host, port=up.bootstrap_port, lease_ttl=args.lease_ttl)
    for command in {command for command, _ in up.roles()}:
        _worker_config(args, up, command, "", external, None)
    return up, external


def plan_cluster(args: argparse.Namespace) -> ClusterPlan:
    """Validate, then resolve the model and the ports: every process's command line."""
    up, external = validate(args)
    token = up.cluster_token or secrets.token_hex(16)
    model = args.model
    if model is None and builtin_model_dir().is_dir():
        model = str(builtin_model_dir())
    elif model is None:
        from baton.common.models.tiny import default_model_path  # builds it (torch): first use

        model = str(default_model_path())
    try:
        ModelConfig.from_pretrained(model)  # a folder that is no model stops us here
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model}: {e}") from None
    boot_port = up.bootstrap_port or free_port(up.host)
    registry = external or RegistryConfig(f"{up.host}:{boot_port}")
    registry_argv = registry_config.passthrough_argv(registry)
    processes = []
    if external is None:
        boot = BootstrapConfig(
            host=up.host, port=boot_port, lease_ttl=args.lease_ttl, log_level=up.log_level
        )
        processes.append(Process("bootstrap", ["bootstrap", *config_argv(boot)]))
    gpu_ids = visible_gpus(up.gpus, CUDA_VISIBLE_DEVICES.get())
    next_gpu = 0
    launch = secrets.token_hex(4)  # two clusters sharing an etcd registry never share an id
    workers = []
    for command, name in up.roles():
        worker = _worker_config(args, up, command, model, registry, token, f"{name}-{launch}")
        tp = worker.engine.tp_size
        if gpu_ids:
            own = [gpu_ids[(next_gpu + k) % len(gpu_ids)] for k in range(tp)]
            next_gpu += tp
        else:  # every worker's rank k on the k-th GPU it sees
            own = [str(k) for k in range(tp)]
        workers.append((command, name, worker, own))
    sharers = Counter(gpu for *_, own in workers for gpu in own)
    for command, name, worker, own in workers:
        worker = _share_gpus(worker, max(sharers[g] for g in own))
        share = None
        if gpu_ids:
            # its own GPUs first (cuda:0..tp-1), the others after: a prefill worker can
            # then write into a decode worker's pool on another GPU (ipc, NVLink)
            share = ",".join(own + [g for g in gpu_ids if g not in own])
        argv = [command, *worker_argv(worker), *registry_argv]
        processes.append(Process(name, argv, share, worker.worker_id))
    # the router reports the launch id in /health: baton up knows its own router by it
    router = dataclasses.replace(
        _router_config(args, up, model, registry, token), cluster_id=launch
    )
    processes.append(Process("router", ["router", *config_argv(router), *registry_argv]))
    env = {"BATON_CLUSTER_TOKEN": token}
    for name in ("api_key", "admin_api_key"):  # the router's secrets, by its env names
        if getattr(router, name):
            env[f"BATON_{name.upper()}"] = getattr(router, name)
    if up.planner:
        # the planner changes roles through the router's admin endpoint: it needs the key
        # (read from the same variable), made here when the router was given none
        env.setdefault("BATON_ADMIN_API_KEY", secrets.token_hex(16))
        processes.append(Process("planner", planner_argv(up, router)))
    return ClusterPlan(up, model, router, processes, env)


def planner_argv(up: LauncherConfig, router: RouterConfig) -> list[str]:
    """`baton planner` against this cluster's router, held to the router's SLO."""
    slo = f"ttft={router.ttft_slo:g}s,tpot={router.tpot_slo:g}s"
    url = f"http://{up.host}:{router.port}"
    return ["planner", "--url", url, "--slo", slo, "--log-level", up.log_level]


def _share_gpus(worker: WorkerConfig, sharers: int) -> WorkerConfig:
    """A GPU worker that sizes its KV pool itself (`--max-total-tokens auto`) and shares a
    GPU with others takes its part of --gpu-memory-fraction: each would take it all."""
    engine = worker.engine
    if sharers < 2 or engine.max_total_tokens is not None or not engine.device.startswith("cuda"):
        return worker
    fraction = engine.gpu_memory_fraction / sharers
    return dataclasses.replace(
        worker, engine=dataclasses.replace(engine, gpu_memory_fraction=fraction)
    )


def visible_gpus(gpus: str | None, visible: str | None) -> list[str]:
    """The GPUs of ``--gpus`` as the workers' CUDA_VISIBLE_DEVICES must name them: where
    baton up itself sees only some GPUs (``visible``), its ids index those, as in CUDA."""
    ids = gpus.split(",") if gpus else []
    if not visible:
        return ids
    shown = [v.strip() for v in visible.split(",") if v.strip()]
    outside = [i for i in ids if int(i) >= len(shown)]
    if outside:
        raise ValueError(
            f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={visible} shows {len(shown)} GPUs "
            f"(ids 0-{len(shown) - 1}), not {','.join(outside)}"
        )
    return [shown[int(i)] for i in ids]


def _given_registry(args: argparse.Namespace) -> RegistryConfig:
    """The registry companions given without --registry (under a placeholder URL)."""
    return RegistryConfig(
        "etcd://unset",
        username=args.registry_username,
        ca_file=args.registry_ca_file,
        cert_file=args.registry_cert_file,
        key_file=args.registry_key_file,
        tls_server_name=args.registry_tls_server_name,
    )


def worker_argv(config: WorkerConfig) -> list[str]:
    """The flags of `baton worker|prefill|decode` that make `config` again."""
    transfer_from_worker = ("host", "advertise_host", "cluster_token")  # not flags of their own
    return [
        *config_argv(config.engine),
        *config_argv(config.transfer, exclude=transfer_from_worker),
        *config_argv(config),
    ]


def _worker_config(
    args: argparse.Namespace,
    up: LauncherConfig,
    command: str,
    model: str,
    registry: RegistryConfig | None,
    token: str | None,
    worker_id: str | None = None,
) -> WorkerConfig:
    role = COMMAND_ROLES[command]
    tp = {"prefill": up.prefill_tp, "decode": up.decode_tp}.get(role) or args.tp
    return worker_config(
        args,
        role,
        model_path=model,
        tp_size=tp,
        host=up.host,
        advertise_host=None,
        port=0,
        metrics_port=0,
        worker_id=worker_id,
        registry=registry,
        heartbeat_interval=max(0.1, min(1.0, args.lease_ttl / 4)),
        lease_ttl=args.lease_ttl,
        cluster_token=token,
        kv_control_port=0,
        log_level=up.log_level,
    )


def _router_config(
    args: argparse.Namespace,
    up: LauncherConfig,
    model: str,
    registry: RegistryConfig | None,
    token: str | None,
) -> RouterConfig:
    return RouterConfig(
        **option_values(RouterConfig, args, only=ROUTER_OPTIONS),
        host=up.host,
        model=model or None,
        registry=registry,
        cluster_token=token,
        expect_workers=up.worker_counts(),
        log_level=up.log_level,
        # the workers' own flags: one collector and one sampling for the whole cluster
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        otlp_traces_sample_ratio=args.otlp_traces_sample_ratio,
        tpot_slo=args.tpot_slo,  # the workers' own: one SLO for the placement and D's steps
    )


def ports_in_use(plan: ClusterPlan) -> str | None:
    """Why the cluster cannot listen where it would (a port another process holds), or
    None. Checked before any process starts: a router that cannot bind would only exit."""
    ports = [("--port", plan.router.port)]
    if plan.up.bootstrap_port:
        ports.append(("--bootstrap-port", plan.up.bootstrap_port))
    for flag, port in ports:
        with socket.socket(socket.AF_INET6 if ":" in plan.up.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                s.bind((plan.up.host, port))
            except OSError as e:
                return (
                    f"{flag} {port}: {plan.up.host}:{port} is not free ({e.strerror}); another "
                    "cluster or program listens there: stop it, or choose another port"
                )
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
