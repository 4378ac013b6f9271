"""How `bench serve`'s flags spell their values, and the parsers that read them.

The names a flag may take (APIs, SLO metrics, reported latencies), the parsers `option`
hands each flag's text to, and the types whose `str` is the flag's own spelling, so that
`--help` prints a default as it would be typed.
"""

from __future__ import annotations

import argparse

from baton.common.options import parse_limits

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
SLO_METRICS = ("ttft", "tpot", "e2e")
# Latencies the report gives percentiles of (vLLM's names: e2el is end-to-end).
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_slo(text: str) -> dict[str, float]:
    """`"ttft=200ms,tpot=50ms,e2e=2s"` -> {"ttft": 0.2, "tpot": 0.05, "e2e": 2.0} (seconds)."""
    return parse_limits(text, SLO_METRICS)


def endpoint_name(text: str) -> str:
    """`--endpoint`: an API's name or its path ("/v1/chat/completions" is "chat")."""
    by_path = {path: name for name, path in ENDPOINT_PATHS.items()}
    name = by_path.get("/" + text.strip().strip("/"), text.strip())
    if name not in ENDPOINT_PATHS:
        known = [*ENDPOINT_PATHS, *by_path]
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(known)}")
    return name


def metric_names(text: str) -> tuple[str, ...]:
    """`--percentile-metrics`: "ttft,tpot,itl,e2el" (e2e is e2el)."""
    names = tuple(
        "e2el" if n == "e2e" else n for n in (p.strip().lower() for p in text.split(",")) if n
    )
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(PERCENTILE_METRICS)}; got {text!r}"
        )
    return names


def percentiles(text: str) -> tuple[float, ...]:
    """`--metric-percentiles`: "50,90,99" (each in (0, 100])."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated percentiles in (0, 100], e.g. 50,90,99; got {text!r}"
        )
    return values


class Listed(tuple[object, ...]):
    """A list setting that prints as its flag spells it (`--help`: ttft,tpot)."""

    def __str__(self) -> str:
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in self)


class Limits(dict[str, float]):
    """SLO limits that print as `--slo` spells them (`--help`: none when empty)."""

    def __str__(self) -> str:
        return ",".join(f"{k}={v * 1000:g}ms" for k, v in self.items()) or "none"


def slo_flag(text: str) -> dict[str, float]:
    """`--slo`'s parser: `parse_slo`, its errors argparse's."""
    try:
        return Limits(parse_slo(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
