"""Which registry a process uses and how it reaches it: `--registry` and its companions.

    --registry HOST:PORT                          the bootstrap service (`baton bootstrap`)
    --registry etcd://HOST:PORT[,HOST:PORT...][/PREFIX]   an etcd cluster (prefix: /baton)

Secrets never travel on a command line: the etcd password comes only from the environment
(`BATON_REGISTRY_PASSWORD`), a URL with credentials in it is refused, and `RegistryConfig`
keeps the password out of its repr. TLS to etcd is on when a CA file is given.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from baton.common.env import REGISTRY_PASSWORD
from baton.services.registry.base import Registry

PASSWORD_ENV = REGISTRY_PASSWORD.name
DEFAULT_ETCD_PORT = 2379
DEFAULT_ETCD_PREFIX = "/baton"
REGISTRY_GROUP = "registry (membership)"  # the `--help` section of these flags
LEASE_TTL = 5.0  # seconds a worker stays registered without renewing its lease


@dataclass(frozen=True)
class RegistryConfig:
    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "etcd":
            parse_etcd_url(self.url)  # raises ValueError with the reason
        elif not _is_host_port(self.url.removeprefix("bootstrap://")):
            raise ValueError(
                f"--registry {self.url!r}: expected HOST:PORT (the bootstrap service) "
                "or etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"
            )
        if self.kind == "bootstrap" and (self.username or self.ca_file or self.cert_file):
            raise ValueError("credentials and TLS settings apply to an etcd registry only")
        for flag, path in [
            ("--registry-ca-file", self.ca_file),
            ("--registry-cert-file", self.cert_file),
            ("--registry-key-file", self.key_file),
        ]:
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{flag} {path}: not a readable file")

    @property
    def kind(self) -> str:
        return "etcd" if self.url.startswith("etcd://") else "bootstrap"


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """`etcd://h1:p1,h2/prefix` -> ([(h1, p1), (h2, 2379)], "/prefix")."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise ValueError(
            "put etcd credentials in --registry-username and "
            f"{PASSWORD_ENV}, never in the --registry URL"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"--registry {url!r}: no query or fragment expected")
    endpoints = []
    for item in parts.netloc.split(","):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        if not host or "[" in host or (port and not port.isdigit()):
            raise ValueError(f"--registry {url!r}: {item!r} is not HOST or HOST:PORT (IPv4)")
        endpoints.append((host, int(port) if port else DEFAULT_ETCD_PORT))
    prefix = parts.path.rstrip("/") or DEFAULT_ETCD_PREFIX
    return endpoints, prefix


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and "/" not in host and not any(c.isspace() for c in host)


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the registry flags in a group of their own, and return the group."""
    g = next((g for g in parser._action_groups if g.title == REGISTRY_GROUP), None)
    g = g or parser.add_argument_group(REGISTRY_GROUP)
    g.add_argument(
        "--registry",
        default=None,
        help="where workers register: HOST:PORT of the bootstrap service, or "
        "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
    )
    g.add_argument(
        "--registry-username",
        default=None,
        help=f"etcd user; its password is read from {PASSWORD_ENV} only",
    )
    g.add_argument("--registry-ca-file", default=None, help="CA certificate: TLS to etcd")
    g.add_argument("--registry-cert-file", default=None, help="client certificate (etcd mTLS)")
    g.add_argument("--registry-key-file", default=None, help="client key (etcd mTLS)")
    g.add_argument(
        "--registry-tls-server-name",
        default=None,
        help="name etcd's certificate must carry (default: the endpoint's host name)",
    )
    return g


def config_from_args(args: argparse.Namespace) -> RegistryConfig | None:
    """The registry settings of parsed `args`; None without --registry. ValueError when
    they are inconsistent."""
    if not args.registry:
        return None
    return RegistryConfig(
        url=args.registry,
        username=args.registry_username or None,
        password=REGISTRY_PASSWORD.get(),
        ca_file=args.registry_ca_file or None,
        cert_file=args.registry_cert_file or None,
        key_file=args.registry_key_file or None,
        tls_server_name=args.registry_tls_server_name or None,
    )


def passthrough_argv(config: RegistryConfig) -> list[str]:
    """Flags that give a child process the same registry (the password stays in the
    environment, which children inherit)."""
    out = ["--registry", config.url]
    for flag, value in [
        ("--registry-username", config.username),
        ("--registry-ca-file", config.ca_file),
        ("--registry-cert-file", config.cert_file),
        ("--registry-key-file", config.key_file),
        ("--registry-tls-server-name", config.tls_server_name),
    ]:
        if value:
            out += [flag, value]
    return out


def open_registry(
    config: RegistryConfig, cluster_token: str | None, lease_ttl: float = LEASE_TTL
) -> Registry:
    """A client of the configured store; it connects on first use. `lease_ttl` (seconds) is
    what an etcd worker asks for; the bootstrap grants its own. Raises ValueError for
    unusable settings (a file that cannot be read, no etcd client on this Python)."""
    if config.kind == "bootstrap":
        from baton.services.registry.bootstrap import BootstrapRegistry

        return BootstrapRegistry(config.url.removeprefix("bootstrap://"), cluster_token)
    try:
        from baton.services.registry.etcd import EtcdRegistry
    except ImportError as e:  # etcd3aio needs Python >= 3.11
        raise ValueError(f"the etcd registry needs the etcd3aio package: {e}") from None
    endpoints, prefix = parse_etcd_url(config.url)
    return EtcdRegistry(
        endpoints,
        prefix,
        lease_ttl=lease_ttl,
        username=config.username,
        password=config.password,
        ca_cert=_read(config.ca_file),
        client_cert=_read(config.cert_file),
        client_key=_read(config.key_file),
        tls_server_name=config.tls_server_name,
    )


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
