"""The bootstrap service's configuration (`baton bootstrap`; `baton up` reuses the lease)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.options import ConfigError, log_level_option, option, secret_option
from baton.common.rpc.auth import INSECURE_HELP
from baton.services.registry.config import LEASE_TTL


@dataclass(frozen=True)
class BootstrapConfig:
    host: str = option("127.0.0.1", "address to bind", group="network")
    port: int = option(7000, "gRPC port (0 = any free port)", group="network")
    lease_ttl: float = option(
        LEASE_TTL, "seconds a worker stays registered without a heartbeat", group="membership"
    )
    cluster_token: str | None = secret_option(
        "shared secret every caller must present; prefer the environment variable "
        "over the flag, which other local users can read in the process list",
    )
    insecure: bool = option(False, INSECURE_HELP, group="security")
    log_level: str = log_level_option()

    def __post_init__(self) -> None:
        if not self.lease_ttl > 0:
            raise ConfigError(self, "lease_ttl", "must be > 0")
        if not 0 <= self.port < 65536:
            raise ConfigError(self, "port", "must be in [0, 65536)")
