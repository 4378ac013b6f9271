"""`baton up`: a whole cluster on this machine — bootstrap, router, and workers.

With `--registry etcd://...` the workers register in that etcd cluster and no bootstrap is
started. Every flag is checked (services/launcher_config.py) before the first process starts.

Defaults to one prefill and one decode worker (`--prefill N --decode M`); `--workers K`
starts K aggregated workers instead. It generates a cluster token, waits until the
router reports healthy, prints the URL, restarts the bootstrap or the router if one exits
(a few times: services/supervisor.py), and on Ctrl-C or SIGTERM stops every process it
started within `--stop-grace` seconds (workers drain first, SIGKILL after), so no process
is orphaned and every port is freed. Secrets reach the children through their
environment, never their command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
import urllib.request

from baton.common.options import ConfigError
from baton.services import launcher_config
from baton.services.supervisor import Supervisor

log = logging.getLogger("baton.up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launcher_config.add_arguments(parser)


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
    os.environ.update(plan.env)  # children read secrets here; they stay off the ps line
    cluster = Supervisor(log_dir=plan.up.log_dir)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for process in plan.processes:
            gpus = {"CUDA_VISIBLE_DEVICES": process.gpus} if process.gpus is not None else None
            # The cluster cannot lose its bootstrap or its router: those come back.
            restart = process.name in ("bootstrap", "router")
            cluster.start(process.name, process.argv, gpus, restart=restart)
        if not _wait_healthy(plan.url, cluster, plan.up.startup_timeout, lambda: stopping):
            return 1
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


def _wait_healthy(url: str, cluster: Supervisor, timeout: float, stopping) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping():
        dead = cluster.dead()
        if dead:
            log.error("failed to start: %s exited", ", ".join(dead))
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    if not stopping():
        log.error("the router did not become healthy within %.0fs", timeout)
    return False
