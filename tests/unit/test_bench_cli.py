"""`baton bench` flags come from the config dataclasses: each parses into the field it names."""

from __future__ import annotations

import math
from pathlib import Path

from baton.benchmarks import cli as bench_cli
from baton.benchmarks.config import BenchConfig
from baton.benchmarks.sweep_config import SWEPT, parse_shape
from baton.services import cli


def parse(*argv: str):  # type: ignore[no-untyped-def]
    parser = cli.build_parser("bench")
    return parser.parse_args(["bench", *argv])


def test_serve_flags_build_the_config_they_name() -> None:
    args = parse(
        "serve", "--base-url", "http://h:1", "--endpoint", "chat", "--request-rate", "4",
        "--duration", "60", "--num-prompts", "7", "--slo", "ttft=200ms,e2e=5s",
        "--timeout", "7", "--wait-for-workers", "3", "--no-progress", "--out", "r.json",
    )  # fmt: skip
    config = bench_cli.config_from_args(args)
    assert (config.base_url, config.endpoint, config.request_rate) == ("http://h:1", "chat", 4.0)
    assert (config.duration_s, config.num_requests) == (60.0, 7)
    assert config.slo == {"ttft": 0.2, "e2e": 5.0}
    assert (config.request_timeout_s, config.cluster_wait_s, config.progress) == (7.0, 3.0, False)
    assert args.out == Path("r.json")


def test_defaults_are_the_configs() -> None:
    config = bench_cli.config_from_args(parse("serve"), progress=True)
    assert config == BenchConfig()
    assert math.isinf(config.request_rate)


def test_a_sweep_sets_its_own_server_model_and_rate() -> None:
    args = parse(
        "pd-sweep", "--shapes", "1P1D,agg2", "--rates", "2,4", "--model", "/m",
        "--up-args", "--device cuda", "--input-len", "9",
    )  # fmt: skip
    sweep = bench_cli.sweep_config(args)
    assert list(sweep.shapes) == [parse_shape("1P1D"), parse_shape("agg2")]
    assert list(sweep.rates) == [2.0, 4.0]
    assert sweep.model_dir == "/m" and sweep.up_args == ("--device", "cuda")
    assert sweep.bench.model is None and sweep.bench.request_rate == 2.0
    assert sweep.bench.input_len == 9
    assert sweep.repeats == 1
    assert bench_cli.sweep_config(parse("pd-sweep", "--repeats", "3")).repeats == 3
    assert not any(hasattr(args, name) for name in SWEPT if name != "model")
