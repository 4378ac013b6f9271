"""Per-request placement in a real 1P2D cluster: every kind answers as transformers does,
says so in `baton_timings`, is counted, and leaves no page held on any worker."""

from __future__ import annotations

import random
import re
import threading
import urllib.request
from pathlib import Path

import httpx
import pytest

from baton.common.models.tiny import default_model_path
from baton.common.rpc import baton_pb2 as pb
from baton.services.router.placement import KINDS
from tests.conftest import hf_greedy
from tests.integration.cluster import Cluster, cluster

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
SHAPE = ("--prefill", "1", "--decode", "2", "--decode-radix-cache", "--page-size", "4")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def generate(c: Cluster, prompt: list[int]) -> tuple[list[int], dict[str, object]]:
    status, body = c.post(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        },
    )
    assert status == 200, body
    return body["output_ids"], body["baton_timings"]


def scrape(c: Cluster) -> str:
    with urllib.request.urlopen(c.url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def counted(c: Cluster, series: str = "baton_router_placements_total") -> dict[str, float]:
    found = re.findall(rf'^{series}\{{kind="([\w-]+)"\}} ([\d.]+)$', scrape(c), re.M)
    return {kind: float(n) for kind, n in found}


def test_threshold_placement_of_a_chat_in_1p2d(tmp_path: Path) -> None:
    """Turn one is new: P computes it, D holds none of it (full). Turn two repeats turn
    one and its answer: the D that answered computes the 10 new tokens itself (local).
    A long new question after that history: P computes it, and the same D receives only
    the pages it lacks (delta)."""
    model = default_model_path()
    args = (*SHAPE, "--placement", "threshold", "--decode-policy", "cache_aware")
    with cluster(tmp_path, *args) as c:
        turn1 = tokens(100, seed=1)
        out1, timings = generate(c, turn1)
        assert out1 == hf_greedy(model, turn1, MAX_NEW)
        assert timings["placement"] == "disagg-full", timings

        turn2 = turn1 + out1 + tokens(10, seed=2)
        out2, timings = generate(c, turn2)
        assert out2 == hf_greedy(model, turn2, MAX_NEW)
        assert timings["placement"] == "local", timings
        assert "threshold" in str(timings["placement_reason"])

        long_question = turn1 + out1 + tokens(400, seed=3)
        out3, timings = generate(c, long_question)
        assert out3 == hf_greedy(model, long_question, MAX_NEW)
        assert timings["placement"] == "disagg-delta", timings

        assert counted(c) == {"local": 1, "disagg-delta": 1, "disagg-full": 1}
        computed = counted(c, "baton_router_placement_prefill_tokens_total")
        assert computed["disagg-full"] == len(turn1)  # P had seen none of it
        assert 10 <= computed["local"] < 20  # D held turn one and its answer (whole pages)
        assert computed["disagg-delta"] == len(long_question) - 100  # P held turn one
        stats = c.wait_idle()
        assert all(s.pages_in_use == 0 for s in stats)


def test_cost_placement_serves_a_chat_exactly(tmp_path: Path) -> None:
    """The cost model places each turn from the step times the workers report; whatever
    it picks, the answers are transformers' and no page stays held."""
    model = default_model_path()
    with cluster(tmp_path, *SHAPE, "--placement", "cost") as c:
        history: list[int] = []
        kinds = []
        for turn in range(4):
            history += tokens(60, seed=10 + turn)
            out, timings = generate(c, history)
            assert out == hf_greedy(model, history, MAX_NEW)
            assert timings["placement"] in KINDS, timings
            kinds.append(timings["placement"])
            history += out
        assert sum(counted(c).values()) == len(kinds)
        stats = c.wait_idle()
        assert all(s.pages_in_use == 0 for s in stats)
        # each prompt was owed on the worker computing it until its first token: no more
        owed = re.findall(r"^baton_router_prompt_tokens_owed\{[^}]*\} ([\d.]+)$", scrape(c), re.M)
        assert len(owed) == 3 and all(float(n) == 0 for n in owed), owed


def test_a_local_prompt_its_decode_worker_cannot_start_is_placed_again(tmp_path: Path) -> None:
    """The D holding a chat decodes a long answer held to a TPOT no step meets, so it has
    no slack for a prompt beside it: the next turn, placed local there (threshold), is
    handed back unstarted after a quarter of the TTFT SLO and placed again, through P.
    Its answer is transformers'; the hand-back is counted; no page stays held."""
    model = default_model_path()
    slo = ("--tpot-slo", "0.00001", "--ttft-slo", "0.4")
    args = (*SHAPE, "--placement", "threshold", "--decode-policy", "cache_aware", *slo)
    with cluster(tmp_path, *args) as c:
        turn1 = tokens(100, seed=41)
        out1, _ = generate(c, turn1)
        started, ended = threading.Event(), threading.Event()

        def decode_long() -> None:  # local on the D that answered turn one: it starts at once
            body = {
                "model": c.model_name,
                "prompt": turn1 + out1 + tokens(10, seed=42),
                "max_tokens": 1200,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        ended.set()

        long_answer = threading.Thread(target=decode_long)
        long_answer.start()
        try:
            assert started.wait(60)
            turn2 = turn1 + out1 + tokens(10, seed=43)
            out2, timings = generate(c, turn2)
            assert not ended.is_set(), "the long answer ended before the turn was placed"
        finally:
            long_answer.join(120)
        assert ended.is_set()
        assert out2 == hf_greedy(model, turn2, MAX_NEW)
        assert timings["placement"] in ("disagg-full", "disagg-delta"), timings
        assert handed_back(c) == 1
        decodes = {w.worker_id for w in c.workers() if w.role == pb.DECODE}
        assert timings["handed_back_by"] in decodes, timings  # the answer names that D
        stats = c.wait_idle()
        assert all(s.pages_in_use == 0 for s in stats)


def handed_back(c: Cluster) -> float:
    found = re.findall(r"^baton_router_local_handed_back_total ([\d.]+)$", scrape(c), re.M)
    return float(found[0]) if found else 0.0
