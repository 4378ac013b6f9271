"""The pages a live migration sends, on the source's /metrics (issue 41): what the GPU test
reports beside the cutover stall. Today's live migration is a stop-and-copy: at the cutover
the source sends the page of every token the target does not hold but the last."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from tests.integration.cluster import cluster
from tests.integration.test_live_migration import (
    ADMIN,
    AUTH,
    DECODE,
    LONG,
    _expected,
    _generate,
    _prompts,
    _running,
    _wait,
)

pytestmark = pytest.mark.timeout(180)
PAGE = 4
PAGES_OUT = 'baton_worker_role_items{detail="%s",name="migration_pages_out"}'


def test_the_source_counts_the_pages_it_sent_at_the_cutover(tmp_path: Path) -> None:
    (prompt,) = _prompts(1)
    (expected,) = _expected([prompt], LONG)
    args = ["--prefill", "1", "--decode", "2", "--transfer-backend", "tcp", "--page-size", "4"]
    with cluster(tmp_path, *args, env={"BATON_ADMIN_API_KEY": ADMIN}) as c:
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
        c.wait_idle()
        kv_tokens = len(prompt) + move["tokens"] - 1  # the last token is the target's first
        pages = c.worker_metric(source.grpc_address, PAGES_OUT % "cutover")
        assert pages == -(-kv_tokens // PAGE), (pages, kv_tokens)
        assert c.worker_metric(source.grpc_address, PAGES_OUT % "precopy") == 0
