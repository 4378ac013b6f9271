"""`baton up`: a whole cluster on this machine — bootstrap, router, and workers.

With `--registry etcd://...` the workers register in that etcd cluster and no bootstrap is
started. Every flag (declared in services/launcher_options.py) is checked
(services/launcher_config.py) before the first process starts.

Defaults to one prefill and one decode worker (`--prefill N --decode M`); `--workers K`
starts K aggregated workers instead. It generates a cluster token, names each worker in
the registry after its process (`decode-1-<launch id>`), tells the router how many to
expect (`--expect-workers`), and prints "baton is up" only once every worker it started
has joined the router's view (logging which are missing every few seconds meanwhile;
a process that exits, or `--startup-timeout`, ends the wait with an error). With
`--planner` it then starts `baton planner` against its router (services/planner/), which
changes workers' roles in place: a worker started as `decode-1` may serve as a prefill
worker since (its process name and worker id keep the role it was started in; the
router's `GET /admin/workers` and `/health` say what it is now). Then it
restarts the bootstrap or the router if one exits (a few times: services/supervisor.py),
and on Ctrl-C or SIGTERM stops every process it started within `--stop-grace` seconds
(workers drain first, SIGKILL after), so no process is orphaned and every port is freed.
Secrets reach the children through their environment, never their command line.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from baton.common.options import ConfigError
from baton.services import launcher_config, launcher_options
from baton.services.launcher_config import ClusterPlan
from baton.services.supervisor import Supervisor

log = logging.getLogger("baton.up")

POLL_S = 0.3  # how often the router's /health is asked while the cluster starts
REPORT_EVERY_S = 5.0  # how often the log says which workers it still waits for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launcher_options.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s up: %(message)s"
    )
    try:
        plan = launcher_config.plan_cluster(args)
    except ConfigError:
        raise  # the command line names its flag
    except (ValueError, OSError) as e:  # registry settings; a folder that is no model
        log.error("%s", e)
        return 2
    if refusal := launcher_config.ports_in_use(plan):
        log.error("%s", refusal)
        return 2
    os.environ.update(plan.env)  # children read secrets here; they stay off the ps line
    cluster = Supervisor(log_dir=plan.up.log_dir)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        planner = [p for p in plan.processes if p.name == "planner"]
        for process in plan.processes:
            if process in planner:
                continue  # it watches a cluster that serves: started once it does
            gpus = {"CUDA_VISIBLE_DEVICES": process.gpus} if process.gpus is not None else None
            # The cluster cannot lose its bootstrap or its router: those come back.
            restart = process.name in ("bootstrap", "router")
            # A router loads for seconds: a warm spare takes over the port at once.
            spare = [*process.argv, "--standby"] if process.name == "router" else None
            cluster.start(process.name, process.argv, gpus, restart=restart, spare_argv=spare)
        if not _wait_ready(plan, cluster, lambda: stopping):
            return 1
        for process in planner:
            cluster.start(process.name, process.argv, restart=True)
        print(f"baton is up: {plan.url}/v1  ({plan.up.shape}; model {plan.model})", flush=True)
        while not stopping:
            fatal = cluster.supervise()  # etcd is the operator's to restart
            if fatal:
                log.error("%s; stopping the cluster", fatal)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        log.info("stopping the cluster")
        cluster.stop(plan.up.stop_grace)


def _wait_ready(plan: ClusterPlan, cluster: Supervisor, stopping: Callable[[], bool]) -> bool:
    """Wait until every worker this cluster started has joined the router's view and the
    router answers 200, saying every few seconds what it still waits for. False (logged)
    once a process exits or the startup timeout passes; False when stopping."""
    timeout = plan.up.startup_timeout
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + REPORT_EVERY_S
    while not stopping():
        dead = cluster.dead()
        if dead:
            log.error("failed to start: %s exited", ", ".join(dead))
            return False
        answer = _health(plan.url)
        waiting = _waiting_for(plan, answer)
        if waiting is None:
            return True
        now = time.monotonic()
        if now >= deadline:
            log.error("the cluster was not up within %.0fs: still waiting for %s", timeout, waiting)
            return False
        if now >= next_report:
            log.info("waiting for %s", waiting)
            next_report = now + REPORT_EVERY_S
        time.sleep(POLL_S)
    return False


def _health(url: str) -> tuple[int, dict[str, Any]] | None:
    """The router's /health: (HTTP status, body), or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 503: no usable worker yet
        with contextlib.suppress(ValueError):
            return e.code, json.loads(e.read())
        return e.code, {}
    except (OSError, ValueError, http.client.HTTPException):
        return None


def _waiting_for(plan: ClusterPlan, answer: tuple[int, dict[str, Any]] | None) -> str | None:
    """What the cluster still lacks, in words; None once it is up."""
    workers = plan.workers
    if answer is None:
        return f"the router at {plan.url} to answer, and {', '.join(workers.values())} to join it"
    code, body = answer
    if body.get("cluster_id") != plan.router.cluster_id:  # not the router this one started
        return f"the router at {plan.url} to answer (another cluster's router answers there)"
    joined = set(body.get("worker_ids") or ()) & workers.keys()
    missing = [name for worker_id, name in workers.items() if worker_id not in joined]
    if missing:
        return f"{', '.join(missing)} ({len(joined)} of {len(workers)} workers joined)"
    if code != 200:
        return f"the router: {body.get('detail') or f'HTTP {code}'}"
    return None
