"""`baton router`: the OpenAI-compatible HTTP front of the cluster."""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

from baton.services.registry import config as registry_config
from baton.services.router.config import RouterConfig
from baton.services.router.policies import POLICY_NAMES
from baton.services.router.tool_parsers import PARSER_NAMES

log = logging.getLogger("baton.router")

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RouterConfig()
    network = parser.add_argument_group("network")
    network.add_argument("--host", default=defaults.host, help="address to bind")
    network.add_argument("--port", type=int, default=defaults.port, help="HTTP port")

    registry_config.add_arguments(parser)

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=defaults.model,
        help="model folder (tokenizer, chat template, context length); "
        "default: the built-in tiny model",
    )
    model.add_argument(
        "--served-model-name",
        default=defaults.served_model_name,
        help="the model name clients use; default: the model folder's name",
    )

    model.add_argument(
        "--tool-call-parser",
        choices=PARSER_NAMES,
        default=defaults.tool_call_parser,
        help="how tool calls are read from the model's text; auto: by the tokenizer's "
        "tokens (Mistral, Llama 3 JSON, else Hermes/Qwen <tool_call> tags)",
    )

    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=defaults.policy,
        help="how to pick among aggregated workers",
    )
    routing.add_argument(
        "--prefill-policy",
        choices=POLICY_NAMES,
        default=defaults.prefill_policy,
        help="how to pick a prefill worker",
    )
    routing.add_argument(
        "--decode-policy",
        choices=POLICY_NAMES,
        default=defaults.decode_policy,
        help="how to pick a decode worker",
    )

    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=defaults.max_concurrent_requests,
        help="requests served at once; more are refused with 429",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout,
        help="seconds a request may take before it is aborted (0: no limit)",
    )

    security = parser.add_argument_group("security")
    security.add_argument(
        "--api-key",
        default=defaults.api_key,
        help="require 'Authorization: Bearer <key>' on the API; prefer the environment "
        "variable over the flag, which other local users can read in the process list",
    )
    security.add_argument(
        "--admin-api-key",
        default=defaults.admin_api_key,
        help="require 'Authorization: Bearer <key>' on admin endpoints (/flush_cache), "
        "which are refused without one (same advice as --api-key)",
    )
    security.add_argument(
        "--cluster-token",
        default=defaults.cluster_token,
        help="shared secret of the cluster's control plane (same advice as --api-key)",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=defaults.log_level)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host,
        port=args.port,
        registry=registry_config.config_from_args(args),
        model=args.model or None,
        served_model_name=args.served_model_name or None,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        api_key=args.api_key or None,
        admin_api_key=args.admin_api_key or None,
        tool_call_parser=args.tool_call_parser,
        cluster_token=args.cluster_token or None,
        max_concurrent_requests=args.max_concurrent_requests,
        request_timeout=args.request_timeout,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if config.registry is None:
        log.warning("no --registry given: the router knows no workers and answers 503")

    import uvicorn  # imported here: `baton router --help` stays fast

    from baton.services.router.app import create_app

    try:
        app = create_app(config)
    except (OSError, ValueError, KeyError) as e:  # model folder missing or unreadable
        log.error("cannot load the model at %s: %s", config.model or "(built-in)", e)
        return 1
    log.info("router listening on http://%s:%d", config.host, config.port)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for
    # the previous handler: make that a clean exit (status 0) rather than death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
