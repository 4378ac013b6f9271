"""A worker's configuration: its engine, its transfer layer, and how it is reached.

`add_worker_options` declares every worker flag once, from the config dataclasses;
`baton up` declares the same ones (less those it sets per process) and builds the same
configs to refuse a bad value before it starts anything. Importing this module imports
no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

from baton.common.config import EngineConfig, Role, TransferConfig
from baton.common.options import (
    ConfigError,
    add_options,
    log_level_option,
    option,
    option_values,
    secret_option,
)
from baton.common.rpc.auth import INSECURE_HELP
from baton.common.transfer.faults import FaultPlan
from baton.services.registry import config as registry_config
from baton.services.registry.config import LEASE_TTL, REGISTRY_GROUP, RegistryConfig
from baton.services.tracing import (
    check_endpoint,
    check_sample_ratio,
    endpoint_option,
    sample_ratio_option,
)

COMMAND_ROLES: dict[str, Role] = {"worker": "both", "prefill": "prefill", "decode": "decode"}


@dataclass
class SchedulerProcArgs:
    """What the frontend hands its scheduler process (spawned, so it must pickle)."""

    engine: EngineConfig
    to_scheduler: str  # ipc address the frontend pushes to
    from_scheduler: str  # ipc address the frontend pulls from
    transfer: TransferConfig = field(default_factory=TransferConfig)  # prefill/decode roles
    log_level: str = "INFO"
    kv_events: bool = False  # send the prefix cache's KV events to the frontend


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process (its frontend and its scheduler process)."""

    engine: EngineConfig
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = option("127.0.0.1", "address every socket of the worker binds", group="network")
    advertise_host: str | None = option(
        None, "address peers use to reach this worker (default: --host)", group="network"
    )
    port: int = option(0, "gRPC port (0 = any free port)", group="network")
    metrics_port: int = option(0, "HTTP /health + /metrics port (0 = any)", group="network")
    worker_id: str | None = option(
        None, "name in the registry (default: generated)", group="network"
    )
    registry: RegistryConfig | None = None  # where it registers (its own flags: --registry)
    heartbeat_interval: float = option(
        1.0,
        "seconds between lease renewals (at most a third of the lease ttl)",
        group=REGISTRY_GROUP,
    )
    lease_ttl: float = option(
        LEASE_TTL,
        "etcd: seconds this worker stays registered without renewing its lease "
        "(the bootstrap service grants its own)",
        group=REGISTRY_GROUP,
    )
    stream_interval: int = option(
        1,
        "tokens a stream carries in one message after its first (1: each as it is sampled); "
        "more: fewer messages for the router to relay and the client to read, in bigger chunks",
        group="network",
    )
    decode_radix_cache: bool = option(
        False, "decode reuses prefixes from its own radix cache", group="disaggregation"
    )
    kv_events: str = option(
        "on",
        "publish which prefixes the radix cache holds, for the router to route on exactly "
        "(off: no page is hashed, and the router guesses from the prompts it sent)",
        group="memory",
        choices=("on", "off"),
    )
    kv_events_backlog: int = option(
        1024,
        "KV event batches kept for a router that reconnects; one further behind gets a "
        "snapshot of the cache instead",
        group="memory",
    )
    cluster_token: str | None = secret_option(
        "shared secret required from every caller; prefer the environment variable over "
        "the flag, which other local users can read in the process list",
    )
    insecure: bool = option(False, INSECURE_HELP, group="security")
    otlp_traces_endpoint: str | None = endpoint_option()
    otlp_traces_sample_ratio: float | None = sample_ratio_option()
    log_level: str = log_level_option()

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "lease_ttl"):
            if not getattr(self, name) > 0:
                raise ConfigError(self, name, "must be > 0")
        if self.stream_interval < 1:
            raise ConfigError(self, "stream_interval", "must be >= 1")
        if self.kv_events not in ("on", "off"):
            raise ConfigError(self, "kv_events", "must be on or off")
        if self.kv_events_backlog < 1:
            raise ConfigError(self, "kv_events_backlog", "must be >= 1")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(self, name, "must be in [0, 65536)")
        if why := check_endpoint(self.otlp_traces_endpoint):
            raise ConfigError(self, "otlp_traces_endpoint", why)
        if why := check_sample_ratio(self.otlp_traces_sample_ratio):
            raise ConfigError(self, "otlp_traces_sample_ratio", why)

    @property
    def role(self) -> Role:
        return self.engine.role

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host


# Worker fields made from other flags: the transfer layer's from the network ones.
_FROM_WORKER = ("host", "advertise_host", "cluster_token")


def add_engine_options(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    add_options(parser, EngineConfig, exclude=exclude)


def add_worker_options(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """Every worker flag but those in `exclude` (field names of any of the three configs)."""
    add_engine_options(parser, exclude)
    add_options(parser, TransferConfig, exclude=exclude)
    add_options(parser, WorkerConfig, exclude=exclude)
    if "registry" not in exclude:
        registry_config.add_arguments(parser)


def engine_config(args: argparse.Namespace, role: Role, **fixed: object) -> EngineConfig:
    values = {**option_values(EngineConfig, args), **fixed}
    if values.get("model_path") is None:
        from baton.common.models.tiny import default_model_path

        values["model_path"] = str(default_model_path())
    values["role"] = role
    if role == "decode" and not getattr(args, "decode_radix_cache", False):
        values["disable_radix_cache"] = True
        values["host_kv_tokens"] = 0  # no prefix cache, no tier under it (`baton up` passes both)
    if values.get("device", "cpu") == "cpu":
        values["disable_cuda_graph"] = True
    return EngineConfig(**values)


def worker_config(args: argparse.Namespace, role: Role, **fixed: object) -> WorkerConfig:
    """The worker's config from its flags; `fixed` sets fields of any of the three configs
    that have no flag here (`baton up` sets host, ports, registry, TP size... per process).
    Raises ConfigError, or ValueError for inconsistent registry settings."""
    unknown = set(fixed) - {f.name for c in _CONFIGS for f in dataclasses.fields(c)}
    if unknown:
        raise TypeError(f"no worker config has the fields {sorted(unknown)}")

    def fixed_of(cls: type) -> dict[str, object]:
        return {f.name: fixed[f.name] for f in dataclasses.fields(cls) if f.name in fixed}

    worker = {**option_values(WorkerConfig, args), **fixed_of(WorkerConfig)}
    if "registry" not in worker:
        worker["registry"] = registry_config.config_from_args(args)
    transfer = TransferConfig(
        **{
            **option_values(TransferConfig, args),
            **fixed_of(TransferConfig),
            **{k: worker[k] for k in _FROM_WORKER if k in worker},
        }
    )
    if transfer.fault:  # the fake backend would refuse it only once started
        try:
            FaultPlan.parse(transfer.fault)
        except ValueError as e:
            raise ConfigError(transfer, "fault", f"is no fault plan: {e}") from None
    engine = engine_config(args, role, **fixed_of(EngineConfig))
    return WorkerConfig(engine=engine, transfer=transfer, **worker)


_CONFIGS = (EngineConfig, TransferConfig, WorkerConfig)
