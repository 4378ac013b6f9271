"""The processes `baton up` runs: start them, restart the ones the cluster cannot lose, stop
them all within a grace period.

Each child runs in a process group of its own, so that a SIGKILL reaches what it started
too (a worker's scheduler processes); SIGTERM goes to the child alone, which stops its own.
On Linux a child is also killed when `baton up` itself dies (even by SIGKILL): nothing is
orphaned. A child marked `restart` (the bootstrap, the router)
that exits is started again with the same command after a growing delay, up to
`MAX_RESTARTS` times, unless it exits because its port is in use (`exits.ADDRESS_IN_USE`),
which no restart mends; workers are not restarted here (the router routes around a lost
worker). `stop()` sends SIGTERM to the workers and the router, then to the bootstrap (so
that workers deregister while it is still there), and SIGKILLs every process group still
alive when the grace period ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from baton.services import exits

log = logging.getLogger("baton.up")

MAX_RESTARTS = 5
RESTART_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class Child:
    name: str
    argv: list[str]  # `baton` arguments
    env: dict[str, str]
    restart: bool
    popen: subprocess.Popen[bytes]
    restarts: int = 0
    restart_at: float | None = None  # when an exited child starts again
    reported: bool = False  # its exit was logged


@dataclass
class Supervisor:
    log_dir: str | None = None
    command: tuple[str, ...] = (sys.executable, "-m", "baton.services.cli")  # + argv
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        restart: bool = False,
    ) -> None:
        """Run `baton <argv>` as `name`; `env` adds to this process's environment (secrets
        travel there, never on the command line)."""
        child_env = {**os.environ, **(env or {})}
        child = Child(name, argv, child_env, restart, self._spawn(name, argv, child_env))
        self.children.append(child)
        log.info("started %s (pid %d)", name, child.popen.pid)

    def dead(self, names: tuple[str, ...] = ()) -> list[str]:
        return [
            f"{c.name} ({_exit_reason(c.popen.returncode)})"
            for c in self.children
            if c.popen.poll() is not None and (not names or c.name in names)
        ]

    def supervise(self) -> str | None:
        """Restart exited children that may be restarted; report the others once. Returns
        why the cluster cannot go on, or None."""
        now = time.monotonic()
        for child in self.children:
            code = child.popen.poll()
            if code is None:
                continue
            if not child.restart:
                if not child.reported:
                    log.error("%s exited (code %s); the router routes around it", child.name, code)
                    child.reported = True
                continue
            if code == exits.ADDRESS_IN_USE:  # again would fail the same way
                return f"{child.name} exited: {_exit_reason(code)}"
            if child.restart_at is None:
                if child.restarts >= MAX_RESTARTS:
                    return f"{child.name} exited (code {code}) after {child.restarts} restarts"
                delay = RESTART_DELAYS_S[min(child.restarts, len(RESTART_DELAYS_S) - 1)]
                child.restart_at = now + delay
                log.error(
                    "%s exited (code %s); restarting it in %.1fs (restart %d of %d)",
                    child.name,
                    code,
                    delay,
                    child.restarts + 1,
                    MAX_RESTARTS,
                )
            elif now >= child.restart_at:
                child.restarts += 1
                child.restart_at = None
                child.popen = self._spawn(child.name, child.argv, child.env)
                log.info("restarted %s (pid %d)", child.name, child.popen.pid)
        return None

    def stop(self, grace: float) -> None:
        """SIGTERM everyone (the bootstrap last), SIGKILL what is left after `grace` s."""
        deadline = time.monotonic() + grace
        last = [c for c in self.children if c.name == "bootstrap"]
        first = [c for c in self.children if c.name != "bootstrap"]
        for group in (first, last):
            for child in group:
                if child.popen.poll() is None:  # the child itself: a worker stops its own
                    child.popen.send_signal(signal.SIGTERM)
            # The bootstrap gets what remains of the grace once the others are gone.
            group_deadline = deadline if group is last else deadline - min(1.0, grace / 4)
            for child in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(timeout=max(0.0, group_deadline - time.monotonic()))
        for child in self.children:
            if child.popen.poll() is None:
                log.warning("%s did not stop within %.0fs; killing it", child.name, grace)
            # Its own children (a worker's scheduler) may outlive it: kill the group.
            _signal_group(child.popen, signal.SIGKILL)
            child.popen.wait()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        try:
            return subprocess.Popen(
                [*self.command, *argv],
                stdout=out or subprocess.DEVNULL,
                stderr=out or None,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            if out is not None:
                out.close()  # the child has its own copy


def _exit_reason(code: int | None) -> str:
    if code == exits.ADDRESS_IN_USE:
        return "its port is in use by another process"
    return f"exit {code}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)
