"""`baton up`: a whole cluster on this machine — bootstrap, router, and workers.

With `--registry etcd://...` the workers register in that etcd cluster and no bootstrap is
started. Every flag is checked (services/launcher_config.py) before the first process starts.

Defaults to one prefill and one decode worker (`--prefill N --decode M`); `--workers K`
starts K aggregated workers instead. It generates a cluster token, waits until the
router reports healthy, prints the URL, and on Ctrl-C or SIGTERM stops every process it
started (workers drain first), so no process is orphaned and every port is freed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from baton.common.options import ConfigError
from baton.services import launcher_config

log = logging.getLogger("baton.up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launcher_config.add_arguments(parser)


@dataclass
class Cluster:
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    log_dir: str | None = None

    def start(self, name: str, argv: list[str], gpus: str | None = None) -> None:
        cmd = [sys.executable, "-m", "baton.services.cli", *argv]
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            stdout=out or subprocess.DEVNULL,
            stderr=out or None,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self.procs.append((name, proc))
        log.info("started %s (pid %d)", name, proc.pid)

    def dead(self, names: tuple[str, ...] = ()) -> list[str]:
        return [
            f"{n} (exit {p.returncode})"
            for n, p in self.procs
            if p.poll() is not None and (not names or n in names)
        ]

    def stop(self, grace: float = 15.0) -> None:
        # workers first (they drain and deregister), then router and bootstrap
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", name, grace)
                proc.kill()
                proc.wait()


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
    cluster = Cluster(log_dir=plan.up.log_dir)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for process in plan.processes:
            cluster.start(process.name, process.argv, process.gpus)
        if not _wait_healthy(plan.url, cluster, plan.up.startup_timeout, lambda: stopping):
            return 1
        print(f"baton is up: {plan.url}/v1  ({plan.up.shape}; model {plan.model})", flush=True)
        reported: set[str] = set()
        while not stopping:
            dead = cluster.dead(("bootstrap", "router"))  # etcd is the operator's to restart
            if dead:
                log.error("%s exited; stopping the cluster", ", ".join(dead))
                return 1
            for gone in set(cluster.dead()) - reported:  # workers: route around them
                log.error("%s exited; the router keeps serving with the others", gone)
                reported.add(gone)
            time.sleep(0.2)
        return 0
    finally:
        log.info("stopping the cluster")
        cluster.stop()


def _wait_healthy(url: str, cluster: Cluster, timeout: float, stopping) -> bool:  # type: ignore[no-untyped-def]
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
