"""Exact KV events on a real cluster: the router follows every worker's cache, routes a
second turn to the worker that holds its prefix, and predicts exactly the cached tokens
that worker then reports."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import Cluster, cluster

pytestmark = pytest.mark.timeout(240)

PAGE = 4


def series(c: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(c.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("baton_router_kv_")
    }


def indexed_pages(c: Cluster) -> dict[str, float]:
    return {
        dict(labels)["worker_id"]: value
        for (name, labels), value in series(c).items()
        if name == "baton_router_kv_index_pages"
    }


def counter(c: Cluster, name: str, role: str) -> float:
    return series(c).get((f"baton_router_kv_hit_tokens_{name}_total", (("role", role),)), 0.0)


def complete(c: Cluster, prompt: list[int]) -> dict[str, object]:
    status, body = c.post(
        "/v1/completions",
        {"model": c.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0},
    )
    assert status == 200, body
    return body


def wait_for(check, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_shared_prefix_goes_where_it_is_cached_as_predicted(tmp_path: Path) -> None:
    rng = random.Random(3)
    first = [rng.randrange(10, 2000) for _ in range(41)]
    follow_up = first + [rng.randrange(10, 2000) for _ in range(9)]
    with cluster(tmp_path, "--workers", "2", "--page-size", str(PAGE)) as c:
        # every worker's stream is in sync (an empty snapshot) before any request
        wait_for(lambda: len(indexed_pages(c)) == 2)
        assert set(indexed_pages(c).values()) == {0}
        complete(c, first)
        # the first prompt's full pages (and its output's) are on one worker only
        wait_for(lambda: max(indexed_pages(c).values()) >= len(first) // PAGE)
        pages = indexed_pages(c)
        holder = max(pages, key=pages.__getitem__)
        assert sorted(pages.values())[0] == 0, pages
        predicted_before = counter(c, "predicted", "both")
        found_before = counter(c, "found", "both")

        body = complete(c, follow_up)
        found = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
        # the holder reuses the whole first prompt (page-aligned); the other has nothing
        assert found == len(first) // PAGE * PAGE, json.dumps(body)
        predicted = counter(c, "predicted", "both") - predicted_before
        assert predicted == found
        # the worker's own count reaches the router with its next batch or keepalive
        wait_for(lambda: counter(c, "found", "both") - found_before == found)
        assert indexed_pages(c)[holder] > pages[holder]
        lag = series(c)[("baton_router_kv_event_lag_seconds_count", ())]
        assert lag >= 2  # batches applied, their lag observed


def test_prefill_and_decode_caches_are_both_followed(tmp_path: Path) -> None:
    rng = random.Random(4)
    first = [rng.randrange(10, 2000) for _ in range(33)]
    follow_up = first + [rng.randrange(10, 2000) for _ in range(7)]
    args = ("--prefill", "1", "--decode", "1", "--page-size", str(PAGE), "--decode-radix-cache")
    with cluster(tmp_path, *args) as c:
        wait_for(lambda: len(indexed_pages(c)) == 2)
        complete(c, first)
        # P cached the prompt; D, with its own radix cache, the prompt and its output
        wait_for(lambda: min(indexed_pages(c).values()) >= len(first) // PAGE)
        predicted_before = counter(c, "predicted", "prefill")
        body = complete(c, follow_up)
        found = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
        assert found == len(first) // PAGE * PAGE, json.dumps(body)
        assert counter(c, "predicted", "prefill") - predicted_before == found
        # P reports the hit with its first token (its count reaches the router with its next
        # batch or keepalive); the first prompt found nothing
        wait_for(lambda: counter(c, "found", "prefill") == found)


def test_with_events_off_routing_guesses_as_before(tmp_path: Path) -> None:
    rng = random.Random(5)
    first = [rng.randrange(10, 2000) for _ in range(41)]
    follow_up = first + [rng.randrange(10, 2000) for _ in range(9)]
    with cluster(tmp_path, "--workers", "2", "--page-size", str(PAGE), "--kv-events", "off") as c:
        complete(c, first)
        body = complete(c, follow_up)
        # the approximate tree sends the follow-up where the first prompt went
        found = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
        assert found == len(first) // PAGE * PAGE
        assert indexed_pages(c) == {}  # no worker publishes: none is indexed
        assert counter(c, "predicted", "both") == 0
