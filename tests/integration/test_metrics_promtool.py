"""/metrics as Prometheus's own linter and vLLM's dashboards read it (issue #42 item 6).

A real 1P1D cluster serves two requests; then promtool checks the router's scrape (which
carries every worker's series too) and a worker's own. vLLM's names carry a colon, which
promtool's lint flags in vLLM's own /metrics as well: it is the one problem allowed, and
only on those series.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.services.router.vllm_metrics import ALIASES, KV_USAGE_NAMES
from tests.integration.cluster import Cluster, cluster

pytestmark = pytest.mark.timeout(240)

PROMTOOL = shutil.which("promtool")
COLON = "metric names should not contain ':'"


def promtool_problems(text: str) -> list[str]:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0 or problems, "promtool failed without saying why"
    return problems


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("promtool"), "--prefill", "1", "--decode", "1") as c:
        for prompt in ("Hello there", "Once upon a time"):
            status, body = c.post(
                "/v1/completions", {"model": c.model_name, "prompt": prompt, "max_tokens": 5}
            )
            assert status == 200, body
        yield c


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/test.sh installs it)")
def test_promtool_finds_nothing_but_vllm_colons(pd: Cluster) -> None:
    router = scrape(pd.url)
    assert 'baton_worker_role_items{detail=""' in router  # the role statistics are in it
    problems = promtool_problems(router)
    assert all(p.startswith("vllm:") and p.endswith(COLON) for p in problems), problems
    baton_only = [line for line in router.splitlines() if not _named(line).startswith("vllm:")]
    assert promtool_problems("\n".join(baton_only) + "\n") == []
    for worker in pd.workers():
        assert promtool_problems(scrape(f"http://{worker.http_address}")) == []


def test_vllm_series_read_the_cluster(pd: Cluster) -> None:
    text = scrape(pd.url)
    got = samples(text)
    model = frozenset({("model_name", pd.model_name)})

    def value(name: str, **labels: str) -> float:
        return got[(name, model | frozenset(labels.items()))]

    names = {name for name, _ in got}
    for alias in [*ALIASES, *KV_USAGE_NAMES]:
        assert any(n == alias or n.startswith(alias + "_") for n in names), alias
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:generation_tokens_total") == 10
    assert value("vllm:e2e_request_latency_seconds_count") == 2
    assert value("vllm:time_to_first_token_seconds_count") == 2
    assert value("vllm:inter_token_latency_seconds_count") == 8  # 4 gaps a request
    assert value("vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
    assert value("vllm:gpu_cache_usage_perc") == value("vllm:kv_cache_usage_perc")
    prompt_tokens = value("vllm:prompt_tokens_total")
    assert prompt_tokens == value("baton_router_prompt_tokens_total") > 0


def test_the_router_and_the_workers_time_their_garbage_collections(pd: Cluster) -> None:
    """Each collection stops every stream of its process: the router's own, and each
    worker's scheduler process's (federated), are on the router's page from the start."""
    got = samples(scrape(pd.url))
    router = [v for (n, labels), v in got.items() if n == "baton_router_gc_pause_seconds_count"]
    assert router and sum(router) > 0  # young collections happen in any process that serves
    for worker in pd.workers():
        own = samples(scrape(f"http://{worker.http_address}"))
        counts = [v for (n, _), v in own.items() if n == "baton_worker_gc_pause_seconds_count"]
        assert counts and sum(counts) > 0, worker


def _named(line: str) -> str:
    """The metric a line of the text format is about."""
    if line.startswith("#"):
        parts = line.split(" ")
        return parts[2] if len(parts) > 2 else ""
    return line.split("{")[0].split(" ")[0]


async def test_without_vllm_names_promtool_finds_nothing() -> None:
    """`--no-vllm-metrics`: the page an operator's `promtool check metrics` passes whole."""
    from baton.services.router.metrics import RouterMetrics

    metrics = RouterMetrics(lambda: {"prefill": 1, "decode": 1}, "m", vllm_names=False)
    page = (await metrics.render_cluster([])).decode()
    assert "baton_router_requests" in page and "vllm:" not in page
    if PROMTOOL is not None:
        assert promtool_problems(page) == []
    with_names = (await RouterMetrics(lambda: {}, "m").render_cluster([])).decode()
    assert "vllm:num_requests_running" in with_names
