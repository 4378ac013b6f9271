"""The workers a benchmark measured: the router's /health before, during and after a run.

A run on a cluster short of its workers measures another cluster: a sweep's agg4 that
starts while three of its four workers still load measures one GPU. So a run reads
/health before it sends anything; where the router names the workers it expects
(`--expect-workers`, which `baton up` sets), the run waits a bounded time for the missing
ones and is refused without them. While it runs, /health is read every `WATCH_EVERY_S`;
a worker that leaves meanwhile (fewer workers than at the start, or fewer than
expected at the end) marks the run partial. A worker changing role (the router's
`changing`, as under `baton planner`) has not left: only the total counts, not its roles. A server whose /health counts no workers (no
baton router) is measured as before, and its readings say so. `host_description` names
the machine the benchmark ran from, and its GPUs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

import httpx

from baton.services.router.config import missing_workers

WATCH_EVERY_S = 1.0
WAIT_POLL_S = 0.25


def host_description() -> str:
    """This machine in one line for a recorded result: name, CPUs and, where nvidia-smi
    answers, its GPUs (a cluster that `baton up` starts here runs on them)."""
    text = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            names = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.split("\n")  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            names = []
        gpus = collections.Counter(n.strip() for n in names if n.strip())
        if gpus:
            text += "; GPUs: " + ", ".join(f"{k}x {name}" for name, k in gpus.items())
    return text + ")"


@dataclass(frozen=True)
class Reading:
    """One answer of /health; `http_status` None when none came."""

    http_status: int | None = None
    status: str | None = None  # the router's: "ok", "partial" or "unavailable"
    workers: dict[str, int] | None = None  # joined, by role; None: no worker counts
    expected: dict[str, int] | None = None  # by role; None: the router expects none
    worker_ids: list[str] | None = None
    changing: list[str] | None = None  # ids of workers changing role (out of `workers`)

    @classmethod
    def from_answer(cls, http_status: int, body: object) -> Reading:
        if not isinstance(body, dict):
            return cls(http_status)
        workers, expected = body.get("workers"), body.get("expected")
        ids, changing = body.get("worker_ids"), body.get("changing")
        return cls(
            http_status,
            body.get("status") if isinstance(body.get("status"), str) else None,
            _counts(workers),
            _counts(expected),
            sorted(str(i) for i in ids) if isinstance(ids, list) else None,
            sorted(str(i) for i in changing) if isinstance(changing, dict) else None,
        )

    @classmethod
    def of(cls, response: httpx.Response) -> Reading:
        try:
            body = response.json()
        except ValueError:
            body = None
        return cls.from_answer(response.status_code, body)

    @property
    def missing(self) -> dict[str, int]:
        """Workers of each role the router expects and has not seen join (a worker
        changing role has joined, whichever role it is counted short in)."""
        if self.expected is None:
            return {}
        missing = missing_workers(self.expected, self.workers or {})
        return {} if sum(missing.values()) <= len(self.changing or ()) else missing

    @property
    def total(self) -> int | None:
        """Workers joined, those changing role included."""
        if self.workers is None:
            return None
        return sum(self.workers.values()) + len(self.changing or ())

    def describe(self) -> str:
        """The cluster in words, e.g. "prefill 1 of 1, decode 1 of 2 workers joined"."""
        if self.http_status is None:
            return "/health did not answer"
        if self.workers is None:
            return f"/health answered {self.http_status} without worker counts"
        expected = self.expected or {}
        parts = [
            f"{role} {n}" + (f" of {expected[role]}" if role in expected else "")
            for role, n in self.workers.items()
            if n or expected.get(role)
        ]
        return (", ".join(parts) or "no") + " workers joined"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


async def read_health(client: httpx.AsyncClient, base_url: str) -> Reading:
    try:
        response = await client.get(base_url.rstrip("/") + "/health", timeout=5.0)
    except httpx.HTTPError:
        return Reading()
    return Reading.of(response)


async def wait_complete(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> Reading:
    """Read /health until no expected worker is missing, for up to `timeout_s`; the last
    reading (which may still miss some)."""
    deadline = time.monotonic() + timeout_s
    reading = await read_health(client, base_url)
    while reading.missing and time.monotonic() < deadline:
        await asyncio.sleep(WAIT_POLL_S)
        reading = await read_health(client, base_url)
    return reading


@dataclass
class Presence:
    """The workers one run saw: at its start, at its end, and the fewest in between."""

    start: Reading
    end: Reading | None = None
    fewest: dict[str, int] | None = None  # per role, over every reading of the run
    lost: list[str] = field(default_factory=list)  # ids at the start missed by a reading
    fewest_total: int | None = None  # workers (changing role or not), over every reading

    @property
    def partial(self) -> str | None:
        """Why the run measured fewer workers than it started with; None if it did not."""
        start = self.start.workers
        if start is None or self.fewest is None:
            return None
        short = []
        fewest_total = self.start.total if self.fewest_total is None else self.fewest_total
        # a worker changing role keeps the total and is not lost; one that left is either
        if (fewest_total or 0) < (self.start.total or 0) or self.lost:
            short = [
                f"{role} {n} at the start, {self.fewest.get(role, 0)} during the run"
                for role, n in start.items()
                if self.fewest.get(role, 0) < n
            ] or [f"{self.start.total} workers at the start, {fewest_total} during the run"]
        if self.end is not None and self.end.missing:
            short.append(f"at the end {self.end.describe()}")
        if not short:
            return None
        lost = f" (lost {', '.join(self.lost)})" if self.lost else ""
        return "; ".join(short) + lost

    def note(self, reading: Reading) -> None:
        if reading.workers is None or self.fewest is None:
            return  # no answer: the run's failed requests tell
        self.fewest = {
            role: min(n, reading.workers.get(role, 0)) for role, n in self.fewest.items()
        }
        totals = [t for t in (self.fewest_total, self.start.total, reading.total) if t is not None]
        self.fewest_total = min(totals)
        if reading.worker_ids is not None:
            present = set(reading.worker_ids) | set(reading.changing or ())
            gone = set(self.start.worker_ids or ()) - present
            self.lost += sorted(gone - set(self.lost))

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start.to_dict(),
            "end": None if self.end is None else self.end.to_dict(),
            "fewest": self.fewest,
            "fewest_total": self.fewest_total,
            "lost": self.lost,
            "partial": self.partial,
        }


class Watch:
    """Reads /health every `every_s` while a run is inside `async with`; `presence` holds
    what it saw (its end reading once the block has left)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        start: Reading,
        every_s: float = WATCH_EVERY_S,
    ) -> None:
        self._client = client
        self._base_url = base_url
        self._every_s = every_s
        fewest = None if start.workers is None else dict(start.workers)
        self.presence = Presence(start, fewest=fewest)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        end = await read_health(self._client, self._base_url)
        self.presence.note(end)
        self.presence.end = end

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            self.presence.note(await read_health(self._client, self._base_url))


def _counts(value: object) -> dict[str, int] | None:
    if not isinstance(value, dict):
        return None
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int)}
