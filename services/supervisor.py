"""The processes `baton up` runs: start them, restart the ones the cluster cannot lose, stop
them all within a grace period.

Each child runs in a process group of its own, so that a SIGKILL reaches what it started
too (a worker's scheduler processes); SIGTERM goes to the child alone, which stops its own.
On Linux a child is also killed when `baton up` itself dies (even by SIGKILL): nothing is
orphaned. A child marked `restart` (the bootstrap, the router)
that exits is started again with the same command, at once the first time and after a
growing delay the next ones, up to `MAX_RESTARTS` times, unless it exits because its port
is in use (`exits.ADDRESS_IN_USE`), which no restart mends. A child given a `spare_argv`
(the router, whose imports and tokenizer take seconds, tens on a loaded machine) has a warm
spare once it has run `SPARE_AFTER_S`: a process of that command that loads everything and
waits for a line on its stdin; a restart hands it the port at once instead of starting cold; workers are not restarted here (the router routes around a lost
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
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # a crash is restarted at once; a crash loop not
SPARE_AFTER_S = 3.0  # a spare loading beside a child that has just started slows it down


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
    spare_argv: list[str] | None = None  # a warm spare's command (see the module docstring)
    spare: subprocess.Popen[bytes] | None = None
    started_at: float = field(default_factory=time.monotonic)


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
        spare_argv: list[str] | None = None,
    ) -> None:
        """Run `baton <argv>` as `name`; `env` adds to this process's environment (secrets
        travel there, never on the command line). `spare_argv`: see the module docstring."""
        child_env = {**os.environ, **(env or {})}
        popen = self._spawn(name, argv, child_env)
        child = Child(name, argv, child_env, restart, popen, spare_argv=spare_argv)
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
                self._keep_spare(child, now)
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
                child.started_at = now
                spare = self._take_spare(child)
                child.popen = spare or self._spawn(child.name, child.argv, child.env)
                how = "its warm spare" if spare else "a cold start"
                log.info("restarted %s (pid %d, %s)", child.name, child.popen.pid, how)
        return None

    def _keep_spare(self, child: Child, now: float) -> None:
        if child.spare_argv is None or now - child.started_at < SPARE_AFTER_S:
            return
        if child.spare is not None and child.spare.poll() is None:
            return
        if child.spare is not None:
            log.warning("%s's spare exited (%s)", child.name, _exit_reason(child.spare.returncode))
        child.spare = self._spawn(child.name, child.spare_argv, child.env, stdin=subprocess.PIPE)
        log.info("started a spare %s (pid %d)", child.name, child.spare.pid)

    def _take_spare(self, child: Child) -> subprocess.Popen[bytes] | None:
        """The child's spare, told to take over; None when it has none alive."""
        spare, child.spare = child.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        try:
            spare.stdin.write(b"serve\n")
            spare.stdin.close()
        except OSError:  # it exited meanwhile
            return None
        return spare

    def stop(self, grace: float) -> None:
        """SIGTERM everyone (the bootstrap last), SIGKILL what is left after `grace` s."""
        deadline = time.monotonic() + grace
        for child in self.children:  # spares serve nobody; they hold no state
            if child.spare is not None:
                _signal_group(child.spare, signal.SIGKILL)
                child.spare.wait()
                child.spare = None
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

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str], stdin: int = subprocess.DEVNULL
    ) -> subprocess.Popen[bytes]:
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        try:
            return subprocess.Popen(
                [*self.command, *argv],
                stdout=out or subprocess.DEVNULL,
                stderr=out or None,
                stdin=stdin,
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
