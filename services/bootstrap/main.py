"""`baton bootstrap`: run the membership registry until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from baton.common.options import add_options, option_values
from baton.common.rpc.auth import bind_address, token_refusal
from baton.services.bootstrap.config import BootstrapConfig
from baton.services.bootstrap.server import serve

log = logging.getLogger("baton.bootstrap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, BootstrapConfig)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = BootstrapConfig(**option_values(BootstrapConfig, args))
    refusal = token_refusal(config.cluster_token, config.insecure, "the bootstrap")
    if refusal:
        log.error("%s", refusal)
        return 2
    if not config.cluster_token:
        log.warning("no cluster token (--insecure): anyone who reaches the port may register")
    try:
        asyncio.run(_serve_until_signalled(config))
    except (OSError, ValueError) as e:  # cannot bind; malformed token
        log.error("%s", e)
        return 1
    return 0


async def _serve_until_signalled(config: BootstrapConfig) -> None:
    server, port = await serve(config.host, config.port, config.lease_ttl, config.cluster_token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "bootstrap listening on %s (lease ttl %.1fs, cluster token %s)",
        bind_address(config.host, port),
        config.lease_ttl,
        "required" if config.cluster_token else "not set",
    )
    await stop.wait()
    log.info("shutting down")
    await server.stop(grace=1.0)
