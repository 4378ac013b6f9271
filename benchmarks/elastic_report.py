"""A sweep over a changing workload (`--phases`) and shapes the planner moves
(`1P3D+planner`): what each run's phases did, what the planner decided during it, and the
sections of report.md that say so (issue 41's target: the planner's goodput over the whole
run against the best fixed shape's, with no failed request), with what its flips'
migrations did (the router's /metrics before and after the run: `migration_report.py`).

The planner logs one line per window (`services/planner/main.py`), the cluster's
`planner.log` under `--log-dir`; a decision is a line of it that starts with `flip` or
`hold`, a role flip one that ends `; done: <worker> is <role> after <s>s`.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from baton.benchmarks.sweep_config import SweepPoint

_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ planner: (?P<message>(flip|hold) .*)$"
)
_SPLIT = re.compile(r"P:D (\d+):(\d+)")


def planner_decisions(log: Path, start: float, end: float) -> list[dict[str, object]]:
    """The planner's decisions logged between `start` and `end` (time.time()), each with
    its time from `start`, whether it flipped a worker, and its line."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out: list[dict[str, object]] = []
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        # the planner's asctime: local time, as time.time() is read here
        at = datetime.datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if not start <= at <= end:
            continue
        message = match["message"]
        split = _SPLIT.search(message)
        out.append(
            {
                "at_s": round(at - start, 1),
                "time": match["at"],  # as logged: the planner's local time
                "flip": message.startswith("flip") and "; done:" in message,
                "split": f"{split[1]}:{split[2]}" if split else None,  # P:D it decided on
                "line": message,
            }
        )
    return out


def render(points: list[SweepPoint], at: dict[float, str]) -> list[str]:
    """report.md's sections on phases and the planner (none for a sweep without either);
    `at` names each rate's load in words."""
    lines: list[str] = []
    phased = [p for p in points if p.phases]
    if phased:
        names = [str(phase["phase"]) for phase in phased[0].phases or []]
        lines += [
            "## Goodput by phase",
            "",
            "Good requests/s over each phase's span (its first send to its last answer), "
            "then over the whole run; failed requests in brackets.",
            "",
            "| shape | load | " + " | ".join(names) + " | whole run |",
            "|---|---|" + "---:|" * (len(names) + 1),
        ]
        for p in phased:
            cells = [f"{ph['goodput']:.2f} ({ph['failed']})" for ph in p.phases or []]
            whole = "n/a" if p.summary is None else f"{p.summary.goodput:.2f} ({p.summary.failed})"
            lines.append(f"| {p.shape} | {at[p.rate]} | " + " | ".join([*cells, whole]) + " |")
        lines.append("")
    planned = [p for p in points if p.planner is not None]
    if planned:
        lines += ["## The planner", "", *_against_fixed(points), ""]
    for p in planned:
        decisions = p.planner or []
        flips = [d for d in decisions if d["flip"]]
        lines += [
            f"### {p.shape} @ {at[p.rate]}: {len(flips)} role flips, {len(decisions)} decisions",
            "",
            *_migrations(p.migrations),
            "Seconds from the run's start; every decision line as the planner logged it.",
            "",
            "```",
            *(f"{d['at_s']:>7} {'FLIP ' if d['flip'] else ''}{d['line']}" for d in decisions),
            "```",
            "",
        ]
    return lines


def _migrations(report: dict[str, Any] | None) -> list[str]:
    """What the flips' migrations did (`migration_report.py`): a line and a blank, or none
    when the router's /metrics were not read."""
    if report is None:
        return []

    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"

    moved = ", ".join(f"{n} {kind}" for kind, n in report["migrations"].items()) or "none"
    c = report["cutover"]
    return [
        f"Streams migrated: {moved}; prompt tokens recomputed: {report['recomputed_tokens']}. "
        f"Cutover (the old worker's last output to the new one's first), {c['count']}: "
        f"mean {ms(c['mean_s'])}, p50 <= {ms(c['p50_at_most_s'])}, "
        f"p99 <= {ms(c['p99_at_most_s'])}, max <= {ms(c['max_at_most_s'])}; longest stall "
        f"of a migrated stream to its end <= {ms(report['stall_max_at_most_s'])}.",
        "",
    ]


def _against_fixed(points: list[SweepPoint]) -> list[str]:
    """Each planner run's goodput over the whole run against the best fixed shape's at the
    same load (the issue's target: 1.2x, with no failed request)."""
    rows = ["| planner run | load | goodput | failed | best fixed shape | its goodput | ratio |"]
    rows.append("|---|---:|---:|---:|---|---:|---:|")
    for p in points:
        if p.planner is None or p.summary is None:
            continue
        fixed = [
            q
            for q in points
            if q.rate == p.rate and q.planner is None and q.summary and not q.partial
        ]
        best = max(fixed, key=lambda q: q.summary.goodput if q.summary else 0.0, default=None)
        if best is None or best.summary is None:
            rows.append(f"| {p.shape} | {p.rate:g} | {p.summary.goodput:.2f} | "
                        f"{p.summary.failed} | none | | |")  # fmt: skip
            continue
        ratio = p.summary.goodput / best.summary.goodput if best.summary.goodput else None
        rows.append(
            f"| {p.shape} | {p.rate:g} | {p.summary.goodput:.2f} | {p.summary.failed} | "
            f"{best.shape} | {best.summary.goodput:.2f} | "
            + ("n/a" if ratio is None else f"{ratio:.2f}x")
            + " |"
        )
    return rows
