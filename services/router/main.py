"""`baton router`: the OpenAI-compatible HTTP front of the cluster."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from types import FrameType

from baton.common.options import ConfigError, add_options, option_values
from baton.common.rpc.auth import short_token_refusal
from baton.services import exits
from baton.services.httpguard import KEEP_ALIVE_TIMEOUT_S, guarded_http_protocol
from baton.services.registry import config as registry_config
from baton.services.router.config import RouterConfig

log = logging.getLogger("baton.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, RouterConfig)
    registry_config.add_arguments(parser)
    # Not a RouterConfig field: it says how this process starts, not how the router serves.
    parser.add_argument(
        "--standby",
        action="store_true",
        help="load everything, then wait for a line on stdin before taking the port "
        "(`baton up` keeps such a warm spare to replace a router that exits)",
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ConfigError (names the flag) or ValueError (the registry's settings)."""
    registry = registry_config.config_from_args(args)
    return RouterConfig(**option_values(RouterConfig, args), registry=registry)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except ConfigError:
        raise  # the command line names its flag
    except ValueError as e:
        log.error("%s", e)
        return 2
    if refusal := short_token_refusal(config.cluster_token, "the router"):
        log.error("%s", refusal)
        return 2
    if config.registry is None:
        log.warning("no --registry given: the router knows no workers and answers 503")

    import uvicorn  # imported here: `baton router --help` stays fast

    if config.model is not None:  # the built-in model is written by torch's transformers
        _import_transformers_without_torch()
    from baton.common.engine.process import freeze_heap
    from baton.services.router.app import create_app
    from baton.services.router.metric_collectors import ROUTER_GC_PAUSES

    sock: socket.socket | int | None = None
    if not args.standby:  # before the model loads: a port in use is said at once
        sock = _listen(config)
        if isinstance(sock, int):
            return sock
    try:
        app = create_app(config)
    except (OSError, ValueError, KeyError) as e:  # model folder missing or unreadable
        log.error("cannot load the model at %s: %s", config.model or "(built-in)", e)
        return 1
    if sock is None:  # a standby: loaded, it takes the port when told
        log.info("standby router loaded (pid %d); waiting to take over", os.getpid())
        if not sys.stdin.readline():  # EOF: whoever kept the spare is gone
            _exit_now(0)
        log.info("standby router taking over")
        sock = _listen(config)
    if isinstance(sock, int):
        return sock
    log.info("router listening on http://%s:%d", config.host, config.port)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for
    # the previous handler: make that a clean exit (status 0) rather than death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=config.log_level,
            access_log=config.log_level == "debug",
            timeout_graceful_shutdown=5,
            http=guarded_http_protocol(config.header_timeout),
            timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        )
    )
    # what the app holds once loaded (its modules, tokenizer and templates: some 266k objects,
    # a full collection 163 ms on the development machine) out of the collector's sight
    freeze_heap()
    ROUTER_GC_PAUSES.start()
    server.run(sockets=[sock])
    _exit_now(0)
    return 0


def _import_transformers_without_torch() -> None:
    """Import transformers as if torch were not installed (unless torch is loaded already).

    The router runs no model, but transformers imports torch at its own import whenever
    torch is installed, and no setting turns that off: ~3 s of every router's start-up on
    a 2-core host, paid again by `baton up`'s spare. transformers decides once per process
    whether torch is there, so its tokenizers and chat templates then run without it;
    xgrammar, which checks structured-output grammars, still imports torch itself on the
    first request that has one.
    """
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"
    sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec: not installed
    try:
        import transformers  # noqa: F401
    finally:
        del sys.modules["torch"]


def _listen(config: RouterConfig) -> socket.socket | int:
    """The router's listening socket, or the exit status when it cannot bind."""
    from baton.services.httpserve import bind_socket

    try:
        return bind_socket(config.host, config.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e.strerror or e)
        return exits.ADDRESS_IN_USE if e.errno == errno.EADDRINUSE else 1


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: the server is closed by now, and collecting
    the tokenizer's and transformers' objects at exit takes seconds on a busy machine."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
