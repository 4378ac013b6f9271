"""What a run's migrations did, from two readings of the router's /metrics (issue 41):
migrations by kind and reason, bytes moved, prefill tokens recomputed, role changes, and two
histograms summarized: the cutover (`baton_router_migration_cutover_seconds`: the old
worker's last output to the new worker's first, one per migration) and the stall
(`baton_router_migration_stall_seconds`: per migrated stream, the longest gap from its
migration to its end, later gaps on the new worker included)."""

from __future__ import annotations

from typing import Any

from baton.services.top import Samples

STALL = "baton_router_migration_stall_seconds"
CUTOVER = "baton_router_migration_cutover_seconds"
Grown = dict[tuple[tuple[str, str], ...], float]


def growth(before: Samples, after: Samples, name: str) -> Grown:
    """Each series of `name` by its labels: what it grew by from `before` to `after`."""
    out = {}
    for (n, labels), value in after.items():
        if n == name:
            out[tuple(sorted(labels))] = value - before.get((n, labels), 0.0)
    return out


def histogram_summary(before: Samples, after: Samples, name: str) -> dict[str, Any]:
    """The observations histogram `name` gained: their count, mean, and the bucket bounds
    (upper) of the median, the 99th percentile and the largest (None without any)."""
    buckets = sorted(
        (float(dict(k)["le"]), v) for k, v in growth(before, after, name + "_bucket").items()
    )  # cumulative counts
    count = sum(growth(before, after, name + "_count").values())

    def at_most(share: float) -> float | None:
        return next((le for le, n in buckets if count and n >= share * count), None)

    return {
        "count": int(count),
        "mean_s": sum(growth(before, after, name + "_sum").values()) / count if count else None,
        "p50_at_most_s": at_most(0.5),
        "p99_at_most_s": at_most(0.99),
        "max_at_most_s": at_most(1.0),  # the bucket bound the largest fell under
    }


def migration_report(before: Samples, after: Samples) -> dict[str, Any]:
    """What the run's migrations and role changes did, from two readings of /metrics."""

    def labelled(name: str, *keys: str) -> dict[str, int]:
        grown = growth(before, after, name).items()
        return {"/".join(dict(k)[key] for key in keys): int(n) for k, n in grown if n}

    stall = histogram_summary(before, after, STALL)
    return {
        "migrations": labelled("baton_router_migrations_total", "kind", "reason"),
        "recomputed_tokens": int(
            sum(growth(before, after, "baton_router_migration_recomputed_tokens_total").values())
        ),
        "migration_bytes": int(
            sum(growth(before, after, "baton_router_migration_bytes_total").values())
        ),
        "stalled_streams": stall["count"],
        "stall_mean_s": stall["mean_s"],
        "stall_max_at_most_s": stall["max_at_most_s"],
        "cutover": histogram_summary(before, after, CUTOVER),
        "role_changes": labelled("baton_router_role_changes_total", "role", "outcome"),
    }
