"""`bench serve --dataset mooncake` against the fake server, whose prefix cache keeps every
page: the hit ratio the run records is the server's, and shared blocks really hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.services.cli import main
from tests.integration.test_bench_serve_fake import start_fake

pytestmark = pytest.mark.timeout(120)

TRACE = [
    # a conversation's first turn, then its follow-up (the first's 1,000 tokens and more),
    # then a stranger: 1000 of 1000 + 1500 + 300 prompt tokens can come from the cache
    {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 400, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 800, "input_length": 300, "output_length": 2, "hash_ids": [3]},
    {"timestamp": 60_000, "input_length": 10, "output_length": 2, "hash_ids": [4]},
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_mooncake_replay_records_the_servers_cache_hits(
    tmp_path: Path, endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from baton.common.models.tiny import default_model_path

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    server = start_fake(tmp_path, "fake", "--first-token-delay", "0.01", "--chunk-delay", "0")
    out = tmp_path / "run.json"
    try:
        server.wait_healthy(30)
        code = main(
            ["bench", "serve", "--base-url", server.base_url, "--endpoint", endpoint,
             "--dataset", "mooncake", "--dataset-path", str(trace), "--time-scale", "0.5",
             "--duration", "10", "--tokenizer", str(default_model_path()),
             "--no-progress", "--out", str(out), "--plots", str(tmp_path / "plots")]
        )  # fmt: skip
    finally:
        server.stop()
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["scheduled_s"] for r in data["requests"]] == [0.0, 0.2, 0.4]  # 60 s is past 10
    # The fake's page is 16 tokens: the follow-up hits its first 992 (62 pages) of 1,000.
    assert data["summary"]["cached_prompt_tokens"] == data["total_cached_tokens"] == 992
    assert data["cache_hit_ratio"] == pytest.approx(992 / 2800)
    assert data["total_prefill_tokens"] == 2800 - 992
    assert [r["prompt_tokens"] for r in data["requests"]] == [1000, 1500, 300]
    assert [r["cached_tokens"] for r in data["requests"]] == [0, 992, 0]
    assert [r["output_tokens"] for r in data["requests"]] == [4, 3, 2]
    assert data["trace_prefix_reuse"] == pytest.approx(1000 / 2800)
    for plot in ("latency_cdf", "throughput"):
        assert (tmp_path / "plots" / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "prompt tokens cached" in printed and "992 (35.4%)" in printed
