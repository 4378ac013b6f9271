"""`baton up`'s process supervision: restarts with a budget, a bounded stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from baton.services import exits
from baton.services import supervisor as sup
from baton.services.supervisor import Supervisor

PYTHON = (sys.executable, "-c")
SLEEPER = "import time; time.sleep(60)"


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_restartable_child_comes_back_until_its_budget_is_spent(monkeypatch) -> None:
    monkeypatch.setattr(sup, "RESTART_DELAYS_S", (0.01,))
    monkeypatch.setattr(sup, "MAX_RESTARTS", 2)
    s = Supervisor(command=PYTHON)
    s.start("router", ["raise SystemExit(3)"], restart=True)
    s.start("worker-0", ["raise SystemExit(4)"])
    fatal = None
    deadline = time.monotonic() + 20
    while fatal is None and time.monotonic() < deadline:
        fatal = s.supervise()
        time.sleep(0.01)
    assert fatal == "router exited (code 3) after 2 restarts"
    router, worker = s.children
    assert router.restarts == 2 and worker.restarts == 0 and worker.reported
    s.stop(grace=1)


def test_stop_kills_what_ignores_sigterm_and_its_children_within_the_grace(
    tmp_path: Path,
) -> None:
    # A child that ignores SIGTERM and leaves a grandchild behind (a worker whose
    # scheduler outlives it): both are gone once the grace ends.
    pid_file = tmp_path / "grandchild"
    stubborn = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    s = Supervisor(command=PYTHON, log_dir=str(tmp_path))
    s.start("worker-0", [stubborn])
    s.start("bootstrap", [SLEEPER])
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
    grandchild = int(pid_file.read_text())
    started = time.monotonic()
    s.stop(grace=1.0)
    assert time.monotonic() - started < 3
    assert all(c.popen.poll() is not None for c in s.children)
    assert s.children[1].popen.returncode == -signal.SIGTERM  # the bootstrap stopped nicely
    wait_for(lambda: not _alive(grandchild), 3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (already dead, not yet reaped by its init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_children_die_with_baton_up(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    launcher = (
        "import sys, time\n"
        "from baton.services.supervisor import Supervisor\n"
        f"s = Supervisor(command=(sys.executable, '-c'))\n"
        f"s.start('router', [{SLEEPER!r}])\n"
        f"open({str(pid_file)!r}, 'w').write(str(s.children[0].popen.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
        child = int(pid_file.read_text())
        parent.kill()
        wait_for(lambda: not _alive(child), 5)
    finally:
        parent.kill()
        parent.wait()


def test_a_child_whose_port_is_in_use_is_not_restarted_and_the_reason_is_said(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(sup, "RESTART_DELAYS_S", (0.01,))
    s = Supervisor(command=PYTHON)
    s.start("router", [f"raise SystemExit({exits.ADDRESS_IN_USE})"], restart=True)
    wait_for(lambda: s.children[0].popen.poll() is not None)
    assert s.dead() == ["router (its port is in use by another process)"]
    assert s.supervise() == "router exited: its port is in use by another process"
    assert s.children[0].restarts == 0
    s.stop(grace=1)


def test_a_warm_spare_takes_over_at_once_and_is_replaced(tmp_path: Path, monkeypatch) -> None:
    # The router's restart must not wait for a cold start (seconds of imports, tens on a
    # loaded machine): its spare, loaded and waiting on stdin, takes over when it exits.
    monkeypatch.setattr(sup, "SPARE_AFTER_S", 0.0)
    took_over = tmp_path / "took-over"
    spare = (
        "import os, sys, time\n"
        "if not sys.stdin.readline(): raise SystemExit(0)\n"
        f"open({str(took_over)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(60)\n"
    )
    s = Supervisor(command=PYTHON)
    s.start("router", [SLEEPER], restart=True, spare_argv=[spare])
    (router,) = s.children
    s.supervise()
    first_spare = router.spare
    assert first_spare is not None and router.popen.pid != first_spare.pid
    router.popen.kill()
    router.popen.wait()
    killed = time.monotonic()
    while router.popen.pid != first_spare.pid:
        assert s.supervise() is None
        assert time.monotonic() - killed < 1, "the spare did not take over at once"
    wait_for(lambda: took_over.exists() and took_over.read_text() == f"{first_spare.pid}\n")
    s.supervise()  # the new router gets a spare of its own
    assert router.spare is not None and router.spare.pid != first_spare.pid
    second_spare = router.spare
    s.stop(grace=1)
    assert first_spare.poll() is not None and second_spare.poll() is not None
    assert took_over.read_text() == f"{first_spare.pid}\n"  # the stopped spare never served
