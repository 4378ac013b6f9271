"""`baton planner --url ROUTER --admin-key-file F`: changes workers' roles to meet the SLO.

Every `--window` seconds it reads the router (`observe.py`), decides on the window
(`decide.py`: flip towards the role under pressure, with hysteresis), logs one line with the
numbers, and makes a flip through the router's `POST /admin/workers/{id}/role`, choosing the
least loaded serving worker of the giving role. `--dry-run` decides and logs only. The
router refuses what would leave a role without a worker; the planner never asks for it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from baton.common.options import parse_limits, secret
from baton.services.planner.decide import (
    Decision,
    Policy,
    Slo,
    State,
    after_failed_flip,
    decide,
    describe,
)
from baton.services.planner.observe import Reading, read, window

log = logging.getLogger("baton.planner")

FLIP_TIMEOUT_S = 120.0  # a role change's answer: its drain, the switch, the registration


def parse_slo(text: str) -> Slo:
    """`"ttft=2s,tpot=50ms"` (bench's spelling) -> Slo; both are needed."""
    try:
        limits = parse_limits(text, ("ttft", "tpot"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if set(limits) != {"ttft", "tpot"} or not all(v > 0 for v in limits.values()):
        raise argparse.ArgumentTypeError(
            "give both ttft and tpot, each > 0, e.g. ttft=2s,tpot=50ms"
        )
    return Slo(limits["ttft"], limits["tpot"])


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError("must be > 0")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="a file holding the router's admin API key (or give BATON_ADMIN_API_KEY)",
    )
    parser.add_argument(
        "--admin-api-key",
        type=secret,
        default=None,
        help="the router's admin API key: prefer the environment variable or "
        "--admin-key-file, since argv is visible to local users",
    )
    parser.add_argument(
        "--api-key",
        type=secret,
        default=None,
        help="the router's API key, which /metrics needs unless --metrics-public",
    )
    parser.add_argument(
        "--slo",
        type=parse_slo,
        default="ttft=2s,tpot=20ms",
        help="the SLO the roles are changed to meet (the router's defaults)",
    )
    parser.add_argument(
        "--window", type=_positive(float), default=10.0, help="seconds of one window"
    )
    policy = Policy()
    parser.add_argument(
        "--hold-windows",
        type=_positive(int),
        default=policy.hold_windows,
        help="windows in a row a flip must be called for before it is made",
    )
    parser.add_argument(
        "--cooldown-windows",
        type=int,
        default=policy.cooldown_windows,
        help="windows after a flip during which no other is made",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=policy.min_requests,
        help="a window with fewer finished requests decides nothing",
    )
    parser.add_argument(
        "--donor-limit",
        type=_positive(float),
        default=policy.donor_limit,
        help="the giving role's predicted distance to its SLO (1 = at it) with one worker "
        "fewer, at most",
    )
    parser.add_argument(
        "--short-above",
        type=_positive(float),
        default=policy.short_above,
        help="a role is short of its SLO past this distance to it (1 = at it): below, "
        "noise around the SLO flips nothing",
    )
    parser.add_argument(
        "--drain-timeout",
        type=_positive(float),
        default=60.0,
        help="seconds a flip's drain may take",
    )
    parser.add_argument("--dry-run", action="store_true", help="log the decisions, flip nothing")
    parser.add_argument("--log-level", default="info", help="log level")


def admin_key(args: argparse.Namespace) -> str | None:
    if args.admin_key_file is not None:
        return secret(args.admin_key_file.read_text().strip())
    return args.admin_api_key


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s planner: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scrape buries decisions
    try:
        key = admin_key(args)
    except (OSError, argparse.ArgumentTypeError) as e:
        log.error("--admin-key-file: %s", e)
        return 2
    if key is None:
        log.error(
            "the planner needs the router's admin key: --admin-key-file or BATON_ADMIN_API_KEY"
        )
        return 2
    policy = Policy(
        hold_windows=args.hold_windows,
        cooldown_windows=args.cooldown_windows,
        min_requests=args.min_requests,
        donor_limit=args.donor_limit,
        short_above=args.short_above,
    )
    url = args.url.rstrip("/")
    log.info(
        "watching %s every %gs against TTFT %gs, TPOT %gs%s",
        url,
        args.window,
        args.slo.ttft,
        args.slo.tpot,
        " (dry run: no flip is made)" if args.dry_run else "",
    )
    # Ctrl-C ends the watch
    with (
        httpx.Client(timeout=10.0, trust_env=False) as client,
        contextlib.suppress(KeyboardInterrupt),
    ):
        _loop(client, url, key, args, policy)
    return 0


def _loop(
    client: httpx.Client, url: str, key: str, args: argparse.Namespace, policy: Policy
) -> None:
    state = State()
    old: Reading | None = None
    while True:
        try:
            new = read(client, url, args.api_key, key)
        except httpx.HTTPError as e:  # a router restarting: try again next window
            log.warning("cannot read %s: %s", url, e)
            time.sleep(args.window)
            continue
        if old is not None:
            measured = window(old, new)
            decision = decide(measured, args.slo, policy, state)
            outcome = ""
            if decision.flip_to and args.dry_run:
                outcome = "; dry run: not made"
            elif decision.flip_to:
                outcome = flip(client, url, key, new, decision, args.drain_timeout)
                if not outcome.startswith("; done"):
                    decision = after_failed_flip(decision, policy)
            log.info("%s%s", describe(measured, args.slo, decision), outcome)
            state = decision.state
        old = new
        time.sleep(args.window)


def _load(row: dict[str, Any]) -> int:
    load = row["load"]
    return int(load["in_flight"] + load["running"] + load["queued"])


def flip(
    client: httpx.Client,
    url: str,
    key: str,
    reading: Reading,
    decision: Decision,
    drain_timeout: float,
) -> str:
    """Ask the router to change the least loaded serving worker of the giving role; what
    came of it, for the decision's log line."""
    candidates = [
        w for w in reading.workers if w["role"] == decision.flip_from and w["state"] == "serving"
    ]
    if not candidates:
        return f"; no serving {decision.flip_from} worker to change"
    worker = min(candidates, key=_load)["worker_id"]
    try:
        answer = client.post(
            f"{url}/admin/workers/{worker}/role",
            json={"role": decision.flip_to, "drain_timeout_s": drain_timeout},
            headers={"Authorization": f"Bearer {key}"},
            timeout=drain_timeout + FLIP_TIMEOUT_S,
        )
    except httpx.HTTPError as e:
        return f"; {worker} not changed: {e}"
    if answer.status_code != 200:
        try:
            why = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = answer.text[:200]
        return f"; {worker} not changed ({answer.status_code}): {why}"
    return f"; done: {worker} is {decision.flip_to} after {answer.json()['seconds']:.1f}s"
