"""`bench serve` against a real `baton up` cluster: every metric present and consistent."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import pytest

from baton.benchmarks.config import BenchConfig
from baton.benchmarks.metrics import SERVER_TIMING_FIELDS, TTFT_PHASES
from baton.benchmarks.serve import run_benchmark
from baton.services.cli import main
from tests.integration.cluster import cluster

pytestmark = pytest.mark.timeout(300)


def test_bench_serve_against_baton_up(tmp_path: Path) -> None:
    with cluster(tmp_path, "--prefill", "1", "--decode", "1") as c:
        config = BenchConfig(
            base_url=c.url,
            request_rate=4.0,
            duration_s=4.0,
            num_requests=12,
            input_len=24,
            output_len=12,
            warmup=1,
            seed=3,
            progress=False,
            slo={"ttft": 2.0, "tpot": 0.5},
        )
        result = asyncio.run(run_benchmark(config))
        # A `vllm bench serve` command line against the same cluster, unchanged.
        vllm = f"""
            --backend openai-chat --endpoint /v1/chat/completions --host 127.0.0.1
            --port {c.port} --model {c.model_name} --dataset-name random
            --random-input-len 16 --random-output-len 4 --num-prompts 4 --request-rate 10
            --ignore-eos --percentile-metrics ttft,e2el --metric-percentiles 50,99
            --save-result --result-dir {tmp_path / "vllm"} --disable-tqdm
        """
        assert main(["bench", "serve", *shlex.split(vllm)]) == 0
    [saved] = (tmp_path / "vllm").glob("openai-chat-10qps-*.json")
    data = json.loads(saved.read_text())
    assert (data["completed"], data["failed"], data["total_output_tokens"]) == (4, 0, 16)
    assert data["p99_e2el_ms"] >= data["p50_e2el_ms"] > 0
    s = result.summary
    assert s.completed == s.measured > 0 and s.failed == 0
    assert result.cluster is not None and result.partial is None
    whole = {"both": 0, "prefill": 1, "decode": 1}
    assert result.cluster.start.workers == result.cluster.start.expected == whole
    for stats in (s.ttft, s.tpot, s.itl, s.e2e):
        assert stats is not None and stats.p50 <= stats.p90 <= stats.p99
    assert s.request_throughput > 0 and s.output_token_throughput > 0 and s.goodput >= 0
    for name in SERVER_TIMING_FIELDS:
        assert name in s.server_timings, f"server-side breakdown lacks {name}"
    for r in result.records:
        if r.warmup or not r.success:
            continue
        assert r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s
        assert r.output_tokens == 12, "usage must report exactly max_tokens (EOS ignored)"
        assert r.prompt_tokens is not None and r.prompt_tokens > 0
        assert len(r.itl_s) <= r.output_tokens - 1
        # the phases up to the first token account for the client's TTFT (the rest is
        # the router's SSE write and the client's read)
        assert r.server_timings is not None
        phases = sum(r.server_timings[name] for name in TTFT_PHASES)
        assert -0.005 < r.ttft_s - phases < 0.25, r.server_timings


def test_pd_sweep_small_configuration_on_real_clusters(tmp_path: Path) -> None:
    """A small sweep over real `baton up` clusters finishes well inside 10 minutes and
    writes its report and plots."""
    import time

    from baton.services.cli import main

    out = tmp_path / "sweep"
    t = time.monotonic()
    rc = main(
        [
            "bench",
            "pd-sweep",
            "--shapes",
            "1P1D,agg2",
            "--rates",
            "4",
            "--duration",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--slo",
            "ttft=2s",
            "--out-dir",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert time.monotonic() - t < 600
    report = (out / "report.md").read_text()
    assert "Best shape for the SLOs" in report and "1P1D" in report and "agg2" in report
    # where 1P1D's prompts were computed (agg2's, on the workers that decode them: no row)
    placements = report.split("## Placements")[1].split("\n## ")[0]
    assert "| 1P1D | 4 |" in placements and "agg2" not in placements
    for plot in ("goodput_per_worker.png", "ttft.png", "tpot.png"):
        assert (out / plot).stat().st_size > 1000
    # each run measured every worker of its shape, and says so
    for shape, workers in (("1P1D", {"prefill": 1, "decode": 1}), ("agg2", {"both": 2})):
        run = json.loads((out / "runs" / f"{shape}-rate4.json").read_text())
        joined = {role: n for role, n in run["cluster"]["start"]["workers"].items() if n}
        assert joined == workers and run["partial_cluster"] is None
    # the router's /metrics as the run ended, beside it: how it placed the prompts
    scraped = (out / "runs" / "1P1D-rate4.router_metrics.txt").read_text()
    placed = [line for line in scraped.splitlines() if line.startswith("baton_router_placements_total")]  # fmt: skip
    assert any('kind="disagg-full"' in line and not line.endswith(" 0.0") for line in placed)


@pytest.mark.parametrize("shape", [("--workers", "1"), ("--prefill", "1", "--decode", "1")])
def test_a_mooncake_replay_shares_its_prefixes_on_baton(
    tmp_path: Path, shape: tuple[str, ...]
) -> None:
    """A follow-up turn whose hash ids begin with an earlier prompt's hits baton's prefix
    cache: the trace's sharing is real sharing on the server, and the run records it."""
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with cluster(tmp_path, *shape) as c:
        config = BenchConfig(
            base_url=c.url,
            dataset="mooncake",
            dataset_path=str(trace),
            progress=False,
            request_timeout_s=120,
        )
        result = asyncio.run(run_benchmark(config))
    first, follow_up = result.records
    assert first.success and follow_up.success, (first.error, follow_up.error)
    assert (first.prompt_tokens, follow_up.prompt_tokens) == (700, 1100)
    assert first.cached_tokens == 0
    # At least the first whole block, at most the 700 tokens the first prompt had.
    assert follow_up.cached_tokens is not None and 512 <= follow_up.cached_tokens <= 700
    s = result.summary
    assert s.cached_prompt_tokens == follow_up.cached_tokens
    assert s.prefill_tokens == 1800 - follow_up.cached_tokens
    assert result.prefix_reuse == pytest.approx(700 / 1800)
    # Where baton prefilled them (its default placement), with what each way computed.
    [(kind, use)] = s.placements.items()
    assert kind == ("aggregated" if "--workers" in shape else "disagg-full")
    assert (use.requests, use.prompt_tokens, use.prefill_tokens) == (2, 1800, s.prefill_tokens)
