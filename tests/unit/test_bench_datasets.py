"""Workloads of `baton bench serve`: synthetic prompts, jsonl / ShareGPT files, traces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from baton.benchmarks.config import BenchConfig, BenchConfigError
from baton.benchmarks.datasets import WORDS, synthetic_requests
from baton.benchmarks.serve import make_plan


def write_jsonl(path: Path, records: list[object]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return str(path)


def test_random_prompts_have_the_asked_lengths_and_differ() -> None:
    config = BenchConfig(input_len=40, output_len=7)
    requests = synthetic_requests(config, 20, np.random.default_rng(0))
    assert all(len(r.prompt.split()) == 40 and r.max_tokens == 7 for r in requests)
    assert all(r.ignore_eos and set(r.prompt.split()) <= set(WORDS) for r in requests)
    # Distinct from the first words on: no accidental prefix-cache hits.
    assert len({r.prompt.split()[:4].__repr__() for r in requests}) == 20


def test_range_ratio_spreads_lengths_within_bounds() -> None:
    config = BenchConfig(input_len=100, output_len=50, range_ratio=0.5)
    requests = synthetic_requests(config, 500, np.random.default_rng(1))
    inputs = [r.input_len or 0 for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert 50 <= min(inputs) < 60 and 140 < max(inputs) <= 150
    assert min(outputs) >= 25 and max(outputs) <= 75
    assert abs(np.mean(inputs) - 100) < 5


def test_shared_prefix_groups_share_their_system_prompt() -> None:
    config = BenchConfig(dataset="shared-prefix", num_groups=3, prefix_len=30, input_len=5)
    requests = synthetic_requests(config, 60, np.random.default_rng(2))
    systems = {r.system for r in requests}
    assert len(systems) == 3
    assert all(s is not None and len(s.split()) == 30 for s in systems)
    assert len({r.prompt for r in requests}) > 50


def test_jsonl_prompts_and_sharegpt_conversations(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "plain prompt", "max_tokens": 12},
            {"prompt": "no length given"},
            {
                "conversations": [
                    {"from": "human", "value": "what is up"},
                    {"from": "gpt", "value": "the sky is up there"},
                    {"from": "human", "value": "second turn is ignored"},
                ]
            },
            {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        ],
    )
    config = BenchConfig(dataset="jsonl", dataset_path=path, output_len=9)
    requests = synthetic_requests(config, 6, np.random.default_rng(3))
    by_prompt = {r.prompt: r.max_tokens for r in requests}
    assert by_prompt == {"plain prompt": 12, "no length given": 9, "what is up": 5}
    assert not any(r.ignore_eos for r in requests)


def test_sharegpt_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    turns = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"}]
    path.write_text(json.dumps([{"id": "x", "conversations": turns}]))
    config = BenchConfig(dataset="jsonl", dataset_path=str(path))
    [request] = synthetic_requests(config, 1, np.random.default_rng(0))
    assert (request.prompt, request.max_tokens) == ("hello", 2)


def test_jsonl_without_usable_prompts_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": "no prompt field"}])
    config = BenchConfig(dataset="jsonl", dataset_path=path)
    with pytest.raises(ValueError, match="no usable prompts"):
        synthetic_requests(config, 1, np.random.default_rng(0))


def test_trace_is_replayed_at_recorded_times_scaled(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 12.0, "input_len": 4, "output_len": 3},
            {"timestamp": 10.0, "prompt": "first one", "output_len": 2},
            {"timestamp": 11.0, "input_len": 8, "output_len": 5},
        ],
    )
    config = BenchConfig(dataset="trace", dataset_path=path, time_scale=0.5)
    plan = make_plan(config)
    assert plan.offsets == [0.0, 0.5, 1.0]
    assert [r.max_tokens for r in plan.requests] == [2, 5, 3]
    assert plan.requests[0].prompt == "first one"
    assert len(plan.requests[1].prompt.split()) == 8
    assert all(r.ignore_eos for r in plan.requests)


def test_plan_is_reproducible_and_warmup_comes_on_top() -> None:
    config = BenchConfig(request_rate=5.0, num_requests=10, warmup=3, input_len=6, seed=11)
    a, b = make_plan(config), make_plan(config)
    assert a == b and len(a.offsets) == len(a.requests) == 13


def test_impossible_settings_are_refused() -> None:
    with pytest.raises(BenchConfigError, match="dataset path"):
        BenchConfig(dataset="jsonl")
    with pytest.raises(BenchConfigError, match="unbounded"):
        BenchConfig(request_rate=math.inf, duration_s=10.0)
    with pytest.raises(BenchConfigError, match="SLO"):
        BenchConfig(slo={"latency": 1.0})
