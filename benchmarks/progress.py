"""The live progress bar of a benchmark run: completed / failed / in flight, elapsed."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

# Redrawing takes the GIL from the event loop that launches requests: keep it rare.
REFRESHES_PER_SECOND = 4


class RunProgress:
    """Counters of a run, drawn as a rich progress bar when `enabled`.

    Calls are cheap (a lock and a few integers); drawing happens on rich's own thread.
    """

    def __init__(self, total: int, *, enabled: bool, console: Console | None = None) -> None:
        self.total = total
        self.in_flight = 0
        self.done = 0
        self.failed = 0
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if enabled:
            self._bar = Progress(
                TextColumn("[bold]bench[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed [red]{task.fields[failed]}[/]"),
                TextColumn("in-flight [cyan]{task.fields[in_flight]}[/]"),
                TimeElapsedColumn(),
                console=console,
                refresh_per_second=REFRESHES_PER_SECOND,
            )
            self._task = self._bar.add_task("bench", total=total, failed=0, in_flight=0)

    def __enter__(self) -> RunProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._show()
            self._bar.stop()

    def launched(self) -> None:
        self.in_flight += 1
        self._show()

    def finished(self, *, ok: bool) -> None:
        self.in_flight -= 1
        self.done += 1
        self.failed += not ok
        self._show()

    def skipped(self) -> None:
        """A request that was never sent (its slot came after --duration)."""
        self.done += 1
        self._show()

    def _show(self) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(
                self._task, completed=self.done, failed=self.failed, in_flight=self.in_flight
            )
