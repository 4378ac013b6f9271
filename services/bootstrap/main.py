"""`baton bootstrap`: run the membership registry until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from baton.common.rpc.auth import bind_address
from baton.services.bootstrap.server import serve

log = logging.getLogger("baton.bootstrap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind")
    net.add_argument("--port", type=int, default=7000, help="gRPC port (0 = any free port)")
    leases = parser.add_argument_group("membership")
    leases.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="seconds a worker stays registered without a heartbeat",
    )
    security = parser.add_argument_group("security")
    security.add_argument(
        "--cluster-token",
        default=None,
        help="shared secret every caller must present; prefer the environment variable "
        "over the flag, which other local users can read in the process list",
    )
    parser.add_argument_group("logging").add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.lease_ttl <= 0:
        log.error("--lease-ttl must be > 0, got %s", args.lease_ttl)
        return 2
    try:
        asyncio.run(_serve_until_signalled(args))
    except (OSError, ValueError) as e:  # cannot bind; malformed token
        log.error("%s", e)
        return 1
    return 0


async def _serve_until_signalled(args: argparse.Namespace) -> None:
    server, port = await serve(args.host, args.port, args.lease_ttl, args.cluster_token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "bootstrap listening on %s (lease ttl %.1fs, cluster token %s)",
        bind_address(args.host, port),
        args.lease_ttl,
        "required" if args.cluster_token else "not set",
    )
    await stop.wait()
    log.info("shutting down")
    await server.stop(grace=1.0)
