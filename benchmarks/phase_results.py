"""How each phase of a `--phases` run went: the measured requests scheduled in a phase's
window, summarized as a whole run's are (`metrics.summarize`: goodput over the span from
the phase's first send to its last answer, so that a phase whose backlog spills into the
next is not flattered)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from baton.benchmarks import phases
from baton.benchmarks.config import BenchConfig
from baton.benchmarks.metrics import RequestRecord, Summary, summarize


@dataclass(frozen=True)
class PhaseResult:
    phase: str  # as --phases spells it
    start_s: float  # the phase's window, from the run's start
    end_s: float
    summary: Summary

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "goodput": self.summary.goodput,
            "completed": self.summary.completed,
            "failed": self.summary.failed,
            "summary": msgspec.to_builtins(self.summary),
        }


def phase_results(records: list[RequestRecord], config: BenchConfig) -> list[PhaseResult]:
    """One result per phase of `config.phases` (none without phases)."""
    if not config.phases or config.duration_s is None:
        return []
    out = []
    spans = phases.windows(config.phases, config.duration_s)
    for phase, (start, end) in zip(config.phases, spans, strict=True):
        own = [r for r in records if start <= r.scheduled_s < end]
        summary = summarize(own, config.slo, config.late_threshold_s)
        out.append(PhaseResult(str(phase), start, end, summary))
    return out
