"""`baton up`'s flags: its own options (`LauncherConfig`, the shape of the cluster and how to
run it) and those it declares from the router's, the bootstrap's, the registry's and the
worker's config dataclasses, so every flag has its type, choices and help once.
`launcher_config.plan_cluster` builds every process's config from the parsed flags.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from baton.common.config import EngineConfig
from baton.common.options import (
    ConfigError,
    add_options,
    log_level_option,
    option,
    secret_option,
)
from baton.services.bootstrap.config import BootstrapConfig
from baton.services.registry import config as registry_config
from baton.services.router.config import RouterConfig, WorkerCounts
from baton.services.worker.config import add_worker_options

# Worker fields `baton up` sets per process (or declares once for all its processes).
_SET_PER_PROCESS = (
    "model_path",
    "tp_size",
    "host",
    "advertise_host",
    "port",
    "metrics_port",
    "worker_id",
    "registry",
    "heartbeat_interval",
    "lease_ttl",
    "cluster_token",
    "insecure",  # baton up always has a token
    "kv_control_port",
    "log_level",
)
# Router flags `baton up` passes on (the rest it sets: host, registry, model, log level,
# the workers to expect).
ROUTER_OPTIONS = (
    "port",
    "served_model_name",
    "policy",
    "prefill_policy",
    "decode_policy",
    "placement",
    "ttft_slo",
    "api_key",
    "admin_api_key",
    "metrics_public",
    "vllm_metrics",
    "tool_call_parser",
    "max_concurrent_requests",
    "max_queued_requests",
    "queue_timeout",
    "request_timeout",
    "max_body_bytes",
    "body_timeout",
    "header_timeout",
)
_GPU_LIST = re.compile(r"\d+(,\d+)*")


@dataclass(frozen=True)
class LauncherConfig:
    """`baton up`'s own options (the shape of the cluster and how to run it)."""

    prefill: int | None = option(None, "prefill workers (default 1)", group="cluster shape")
    decode: int | None = option(None, "decode workers (default 1)", group="cluster shape")
    workers: int | None = option(
        None, "aggregated workers instead of prefill/decode (the baseline)", group="cluster shape"
    )
    host: str = option("127.0.0.1", "address every process binds", group="network")
    bootstrap_port: int = option(0, "built-in bootstrap's port (0 = a free port)", group="network")
    gpus: str | None = option(
        None,
        "GPU ids to spread workers over, e.g. 0,1,2,3: worker i computes on its share "
        "(--tp GPUs each, listed first in its CUDA_VISIBLE_DEVICES; the others follow so "
        "KV pages can move GPU to GPU)",
        group="parallelism",
    )
    prefill_tp: int | None = option(
        None, "TP size of prefill workers (default: --tp)", group="parallelism"
    )
    decode_tp: int | None = option(
        None, "TP size of decode workers (default: --tp)", group="parallelism"
    )
    cluster_token: str | None = secret_option(
        "shared secret of the cluster (default: a fresh random token); prefer the "
        "environment variable over the flag, which other local users can read",
    )
    startup_timeout: float = option(
        300.0,
        "seconds to wait until every worker has joined the router; longer is an error",
        group="operation",
    )
    stop_grace: float = option(
        15.0,
        "seconds the processes get to stop on Ctrl-C/SIGTERM before they are killed",
        group="operation",
    )
    planner: bool = option(
        False,
        "run the P:D planner (`baton planner`) once the cluster is up: it changes workers' "
        "roles to meet --ttft-slo and --tpot-slo (its other flags through their "
        "environment variables, e.g. BATON_WINDOW, BATON_DRY_RUN)",
        group="operation",
    )
    log_dir: str | None = option(None, "write each process's log here", group="operation")
    log_level: str = log_level_option("log level of every process", group="operation")

    def __post_init__(self) -> None:
        if self.workers is not None and (self.prefill is not None or self.decode is not None):
            raise ConfigError(
                self, "workers", "is for aggregated workers: use it or --prefill/--decode"
            )
        for name in ("prefill", "decode", "workers", "prefill_tp", "decode_tp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(self, name, "must be >= 1")
        if self.gpus is not None and not _GPU_LIST.fullmatch(self.gpus):
            raise ConfigError(self, "gpus", "must be GPU ids separated by commas, e.g. 0,1")
        if not 0 <= self.bootstrap_port < 65536:
            raise ConfigError(self, "bootstrap_port", "must be in [0, 65536)")
        if not self.startup_timeout > 0:
            raise ConfigError(self, "startup_timeout", "must be > 0")
        if not self.stop_grace > 0:
            raise ConfigError(self, "stop_grace", "must be > 0")
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(self, "host", "must be a host name or address")
        if self.log_dir is not None and os.path.isfile(self.log_dir):
            raise ConfigError(self, "log_dir", "must be a folder")
        if self.planner and self.workers is not None:
            raise ConfigError(self, "planner", "changes prefill/decode workers: not with --workers")

    def roles(self) -> list[tuple[str, str]]:
        """(command, process name) of every worker."""
        if self.workers is not None:
            return [("worker", f"worker-{i}") for i in range(self.workers)]
        return [("prefill", f"prefill-{i}") for i in range(self.prefill or 1)] + [
            ("decode", f"decode-{i}") for i in range(self.decode or 1)
        ]

    def worker_counts(self) -> WorkerCounts:
        """The workers the router is to expect, by role."""
        if self.workers is not None:
            return WorkerCounts(both=self.workers)
        return WorkerCounts(prefill=self.prefill or 1, decode=self.decode or 1)

    @property
    def shape(self) -> str:
        if self.workers is not None:
            return f"{self.workers} aggregated worker(s)"
        return f"{self.prefill or 1} prefill + {self.decode or 1} decode"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, LauncherConfig)
    add_options(parser, RouterConfig, only=ROUTER_OPTIONS)
    add_options(parser, BootstrapConfig, only=("lease_ttl",))
    registry_config.add_arguments(parser)
    add_options(parser, EngineConfig, only=("model_path", "tp_size"))
    add_worker_options(parser, exclude=_SET_PER_PROCESS)
