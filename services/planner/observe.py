"""What the planner reads from a running cluster: the router's `/metrics` (its own series and
every worker's, federated with `worker_id` and `role`) and `GET /admin/workers`, two
readings of which make one `Window`: the growth of every histogram and counter between
them. A worker's series are matched by worker id and name, not by its role label: a worker
that changed role keeps its counts, and a series the earlier reading lacks (a worker that
joined) counts from the next window on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from baton.services.planner.decide import Window
from baton.services.top import Labels, Samples, histogram_quantile, parse

TTFT = "baton_router_time_to_first_token_seconds"
TPOT = "baton_router_time_per_output_token_seconds"
FINISHED = "baton_router_e2e_request_latency_seconds_count"
STAGE = "baton_worker_stage_seconds"


@dataclass(frozen=True)
class Reading:
    at: float  # time.monotonic() when read
    samples: Samples
    workers: tuple[dict[str, Any], ...]  # GET /admin/workers' rows

    def role_of(self) -> dict[str, str]:
        """Worker id -> role, of the workers serving (not draining, switching, suspended)."""
        return {w["worker_id"]: w["role"] for w in self.workers if w["state"] == "serving"}


def read(client: httpx.Client, url: str, api_key: str | None, admin_key: str) -> Reading:
    """One reading of the router at `url`: /metrics (with the API key, when the router
    wants one there) and /admin/workers (with the admin key)."""
    metrics = client.get(url + "/metrics", headers=_bearer(api_key))
    metrics.raise_for_status()
    workers = client.get(url + "/admin/workers", headers=_bearer(admin_key))
    workers.raise_for_status()
    return Reading(time.monotonic(), parse(metrics.text), tuple(workers.json()["workers"]))


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _key(labels: Labels) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in labels if k != "role")


def _grown(new: Samples, old: Samples, name: str, match: dict[str, str]) -> dict[Labels, float]:
    """The growth of each series `name` matching `match` (its role aside), by its labels
    without the role; series the old reading lacks are left out."""
    before = {_key(labels): v for (n, labels), v in old.items() if n == name}
    out: dict[Labels, float] = {}
    for (n, labels), value in new.items():
        if n != name or not all((k, v) in labels for k, v in match.items()):
            continue
        key = _key(labels)
        if key in before:
            out[key] = out.get(key, 0.0) + max(0.0, value - before[key])
    return out


def _total(new: Samples, old: Samples, name: str, match: dict[str, str]) -> float:
    return sum(_grown(new, old, name, match).values())


def _quantile(new: Samples, old: Samples, name: str, q: float) -> float | None:
    counts: dict[float, float] = {}
    for labels, grown in _grown(new, old, name + "_bucket", {}).items():
        le = float(dict(labels)["le"])
        counts[le] = counts.get(le, 0.0) + grown
    return histogram_quantile(sorted(counts.items()), q)


def _stage_mean(new: Samples, old: Samples, stage: str, workers: Iterable[str]) -> float:
    """Mean seconds of a worker stage over `workers` in the window (0 with none)."""
    total = count = 0.0
    for worker_id in workers:
        match = {"stage": stage, "worker_id": worker_id}
        total += _total(new, old, STAGE + "_sum", match)
        count += _total(new, old, STAGE + "_count", match)
    return total / count if count else 0.0


def window(old: Reading, new: Reading) -> Window:
    """What the cluster did between two readings, by the roles its workers have now."""
    roles = new.role_of()
    prefill = [w for w, role in roles.items() if role == "prefill"]
    decode = [w for w, role in roles.items() if role == "decode"]
    seconds = max(new.at - old.at, 1e-9)

    def per_worker(name: str, workers: list[str]) -> float:
        if not workers:
            return 0.0
        grown = sum(_total(new.samples, old.samples, name, {"worker_id": w}) for w in workers)
        return grown / seconds / len(workers)

    return Window(
        seconds=seconds,
        requests=int(_total(new.samples, old.samples, FINISHED, {})),
        ttft=_quantile(new.samples, old.samples, TTFT, 0.9),
        tpot=_quantile(new.samples, old.samples, TPOT, 0.9),
        prefill_queue=_stage_mean(new.samples, old.samples, "queue", prefill),
        decode_admission=_stage_mean(new.samples, old.samples, "decode_admission", decode),
        prefill_workers=len(prefill),
        decode_workers=len(decode),
        prefill_tokens_per_worker=per_worker("baton_worker_prompt_tokens_total", prefill),
        decode_tokens_per_worker=per_worker("baton_worker_generation_tokens_total", decode),
    )
