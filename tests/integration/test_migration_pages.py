"""The pages a live migration sends, on the source's /metrics (issue 41): what the GPU test
reports beside the cutover stall. To a target without a prefix cache the move is a
stop-and-copy: at the cutover the source sends the page of every token but the last. To one
with a prefix cache (`--decode-radix-cache`) the router pre-copies the context's whole pages
while the source decodes on, and the cutover sends only the pages written since."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import Cluster, cluster
from tests.integration.test_live_migration import (
    ADMIN,
    AUTH,
    DECODE,
    LONG,
    _expected,
    _generate,
    _metric,
    _prompts,
    _running,
    _wait,
)

pytestmark = pytest.mark.timeout(180)
PAGE = 4
PAGES_OUT = 'baton_worker_role_items{detail="%s",name="migration_pages_out"}'
ROUTER_PAGES = 'baton_router_migration_pages_total{phase="%s"}'


TCP_1P2D = ["--prefill", "1", "--decode", "2", "--transfer-backend", "tcp", "--page-size", "4"]


def _move_live(c: Cluster, prompt: list[int], expected: list[int]) -> tuple[Any, dict[str, Any]]:
    """Move the one request decoding on `c` live, while it decodes; its answer must equal
    `expected`. The source worker and the router's report of the move."""
    decodes = [w for w in c.workers() if w.role == DECODE]
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_generate, c, 0, prompt, LONG)
        _wait(lambda: any(_running(c, d) for d in decodes), 60, "the request never decoded")
        (source,) = [d for d in decodes if _running(c, d)]
        status, report = c.post("/admin/migrate", {"worker_id": source.worker_id}, 60, AUTH)
        assert status == 200, report
        (move,) = report["moved"]
        assert move["kind"] == "live", move
        status, body = answer.result()
    assert status == 200 and body["output_ids"] == expected
    return source, move


def test_the_source_counts_the_pages_it_sent_at_the_cutover(tmp_path: Path) -> None:
    (prompt,) = _prompts(1)
    (expected,) = _expected([prompt], LONG)
    with cluster(tmp_path, *TCP_1P2D, env={"BATON_ADMIN_API_KEY": ADMIN}) as c:
        source, move = _move_live(c, prompt, expected)
        c.wait_idle()
        kv_tokens = len(prompt) + move["tokens"] - 1  # the last token is the target's first
        pages = c.worker_metric(source.grpc_address, PAGES_OUT % "cutover")
        assert pages == -(-kv_tokens // PAGE), (pages, kv_tokens)
        assert c.worker_metric(source.grpc_address, PAGES_OUT % "precopy") == 0


def _long_prompt() -> list[int]:
    rng = random.Random(42)
    return [rng.randrange(10, 2000) for _ in range(1100)]  # past precopy.MIN_TOKENS


def test_a_precopy_leaves_only_the_delta_for_the_cutover(tmp_path: Path) -> None:
    prompt = _long_prompt()
    (expected,) = _expected([prompt], LONG)
    args = [*TCP_1P2D, "--decode-radix-cache"]
    with cluster(tmp_path, *args, env={"BATON_ADMIN_API_KEY": ADMIN}) as c:
        source, move = _move_live(c, prompt, expected)
        stats = c.wait_idle()  # held: none; the target's warmed pages are cached, evictable
        assert all(s.pages_in_use == 0 for s in stats)
        context_pages = -(-(len(prompt) + move["tokens"] - 1) // PAGE)
        ahead = c.worker_metric(source.grpc_address, PAGES_OUT % "precopy")
        cutover = c.worker_metric(source.grpc_address, PAGES_OUT % "cutover")
        # The target held nothing of this context before: every page travelled once.
        assert ahead + cutover == context_pages, (ahead, cutover, context_pages)
        # Rounds of pre-copy chase the decoding request: the cutover's delta is what its
        # last round left (tokens decoded meanwhile), the partial last page included.
        assert ahead >= len(prompt) // PAGE and cutover < ahead / 4, (ahead, cutover)
        router = [_metric(c, ROUTER_PAGES % phase) for phase in ("precopy", "cutover")]
        assert router == [ahead, cutover]


def test_a_source_killed_during_its_precopy_ends_in_a_recompute_migration(
    tmp_path: Path,
) -> None:
    prompt = _long_prompt()
    (expected,) = _expected([prompt], LONG)
    args = [
        "--prefill", "1", "--decode", "2", "--transfer-backend", "fake", "--page-size", "4",
        "--transfer-fault", "delay:ms=1000", "--room-timeout", "6", "--decode-radix-cache",
    ]  # fmt: skip
    with cluster(tmp_path, *args, env={"BATON_ADMIN_API_KEY": ADMIN}) as c:
        decodes = [w for w in c.workers() if w.role == DECODE]
        with cf.ThreadPoolExecutor(2) as pool:
            answer = pool.submit(_generate, c, 0, prompt, LONG)
            _wait(lambda: any(_running(c, d) for d in decodes), 60, "the request never decoded")
            (source,) = [d for d in decodes if _running(c, d)]
            moving = pool.submit(
                c.post, "/admin/migrate", {"worker_id": source.worker_id}, 60, AUTH
            )
            time.sleep(0.3)  # the pre-copy's pages wait 1 s on the wire: kill the source
            os.kill(c.worker_pid(source.grpc_address), signal.SIGKILL)
            status, body = answer.result()
            move_status, report = moving.result()
        assert status == 200 and body["output_ids"] == expected, body
        assert move_status == 200, report
        assert [m["kind"] for m in report["moved"]] == ["recompute"], report
        assert _metric(c, 'baton_router_migrations_total{kind="live"') == 0
        _wait(lambda: len(c.workers()) == 2, 20, "the dead decode worker never left")
        stats = c.wait_idle()
        assert all(s.pages_in_use == 0 for s in stats)
