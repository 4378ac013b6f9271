"""A workload whose mix changes during the run: `--phases "400:600@8,6000:100@2"`.

Each phase is `IN:OUT@RATE[/SHARE]`: prompts of IN tokens asking for OUT tokens, arriving
at RATE requests a second (open loop, `--burstiness` as a whole run's), for SHARE of
`--duration` (a fraction, 0.25, or a percentage, 25%). Phases run one after the other in
the order given; without shares they split the duration evenly. The whole schedule is
made before the run, as every other one: phase i's arrivals are a schedule of its own
shifted to the phase's start, so that changing one phase leaves the others' arrivals.

Only types and arithmetic live here (the config parses with it; nothing here imports the
config): `serve.make_plan` builds the requests, `phase_results` judges each phase.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace

from baton.benchmarks.schedule import arrival_offsets

SHARE_TOLERANCE = 0.01  # shares that sum to 1 within this are accepted

_PHASE = re.compile(
    r"^\s*(?P<input>\d+)\s*:\s*(?P<output>\d+)\s*@\s*(?P<rate>[0-9]*\.?[0-9]+)"
    r"\s*(?:/\s*(?P<share>[0-9]*\.?[0-9]+)\s*(?P<percent>%?))?\s*$"
)


@dataclass(frozen=True)
class Phase:
    input_len: int  # prompt tokens
    output_len: int  # max_tokens
    rate: float  # requests a second
    share: float  # of the run's duration, in (0, 1]

    def __str__(self) -> str:
        return f"{self.input_len}:{self.output_len}@{self.rate:g}/{self.share:g}"


class Phases(tuple[Phase, ...]):
    """Phases that print as `--phases` spells them (`--help`: none when empty)."""

    def __str__(self) -> str:
        return ",".join(str(phase) for phase in self) or "none"


def parse_phases(text: str) -> Phases:
    """`"400:600@8,6000:100@2/25%"` -> Phases; ValueError naming the bad item."""
    items = [part for part in text.split(",") if part.strip()]
    if not items:
        raise ValueError("phases: give at least one IN:OUT@RATE[/SHARE], e.g. 400:600@8")
    parsed: list[tuple[int, int, float, float | None]] = []
    for item in items:
        match = _PHASE.match(item)
        if match is None:
            raise ValueError(
                f"phase {item.strip()!r}: expected IN:OUT@RATE[/SHARE] (tokens in, tokens "
                "out, requests/s, share of --duration), e.g. 400:600@8/0.5"
            )
        n_in, n_out, rate = int(match["input"]), int(match["output"]), float(match["rate"])
        share = None if match["share"] is None else float(match["share"])
        if share is not None and match["percent"]:
            share /= 100.0
        if n_in < 1 or n_out < 1:
            raise ValueError(f"phase {item.strip()!r}: token counts must be >= 1")
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"phase {item.strip()!r}: the rate must be a number > 0")
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"phase {item.strip()!r}: the share must be in (0, 1] (or %)")
        parsed.append((n_in, n_out, rate, share))
    shares = [share for *_, share in parsed]
    if all(share is None for share in shares):
        shares = [1.0 / len(parsed)] * len(parsed)
    elif any(share is None for share in shares):
        raise ValueError("phases: give every phase a share, or none (an even split)")
    given = [float(share or 0.0) for share in shares]
    if abs(sum(given) - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"phases: the shares sum to {sum(given):g}, not 1")
    return Phases(
        Phase(n_in, n_out, rate, share / sum(given))
        for (n_in, n_out, rate, _), share in zip(parsed, given, strict=True)
    )


def phases_flag(text: str) -> Phases:
    """`--phases`' parser: `parse_phases`, its errors argparse's."""
    try:
        return parse_phases(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def scaled(phases: tuple[Phase, ...], factor: float) -> Phases:
    """The phases at `factor` times their rates (a sweep's load axis)."""
    return Phases(replace(phase, rate=phase.rate * factor) for phase in phases)


def windows(phases: tuple[Phase, ...], duration_s: float) -> list[tuple[float, float]]:
    """Each phase's [start, end) in seconds from the run's start."""
    out, start = [], 0.0
    for phase in phases:
        end = start + phase.share * duration_s
        out.append((start, end))
        start = end
    out[-1] = (out[-1][0], duration_s)  # rounding never leaves a gap at the end
    return out


def phase_offsets(
    phases: tuple[Phase, ...], duration_s: float, *, burstiness: float = 1.0, seed: int = 0
) -> tuple[list[float], list[int]]:
    """The run's send times (ascending) and, per request, the index of its phase."""
    offsets: list[float] = []
    counts: list[int] = []
    for i, (phase, (start, end)) in enumerate(
        zip(phases, windows(phases, duration_s), strict=True)
    ):
        own = arrival_offsets(
            phase.rate, num_requests=None, duration_s=end - start, burstiness=burstiness,
            seed=seed + 7919 * i,
        )  # fmt: skip
        offsets += [start + offset for offset in own]
        counts.append(len(own))
    return offsets, [i for i, n in enumerate(counts) for _ in range(n)]
