"""`vllm bench serve` command lines parse into the run they describe, or are refused."""

from __future__ import annotations

import re
import shlex

import pytest

from baton.benchmarks import cli as bench_cli
from baton.benchmarks.config import BenchConfigError
from baton.services import cli

pytestmark = pytest.mark.timeout(30)

# In the style of vLLM's docs ("Benchmark CLI", `vllm bench serve`), with our command.
VLLM_COMMAND = """
    --backend openai-chat --model Qwen/Qwen2.5-1.5B-Instruct
    --endpoint /v1/chat/completions --host 10.0.0.7 --port 8100
    --dataset-name random --random-input-len 1024 --random-output-len 128
    --random-range-ratio 0.1 --num-prompts 10 --request-rate 4 --burstiness 0.5
    --max-concurrency 8 --seed 42 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el
    --metric-percentiles 25,50,99.9 --goodput ttft:500 tpot:50 e2el:3000
    --temperature 0 --top-p 0.9 --tokenizer-mode auto --disable-tqdm
    --save-result --save-detailed --result-dir /tmp/out --label mine
"""


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return cli.build_parser("bench").parse_args(["bench", "serve", *argv])


def test_a_vllm_command_line_means_the_same_run() -> None:
    args = parse(*shlex.split(VLLM_COMMAND))
    c = bench_cli.config_from_args(args)
    assert (c.base_url, c.endpoint, c.model) == (
        "http://10.0.0.7:8100",
        "chat",
        "Qwen/Qwen2.5-1.5B-Instruct",
    )
    assert (c.dataset, c.input_len, c.output_len, c.range_ratio) == ("random", 1024, 128, 0.1)
    assert (c.num_requests, c.request_rate, c.burstiness) == (10, 4.0, 0.5)
    assert (c.max_concurrency, c.seed, c.ignore_eos, c.progress) == (8, 42, True, False)
    assert c.percentile_metrics == ("ttft", "tpot", "itl", "e2el")
    assert c.metric_percentiles == (25.0, 50.0, 99.9)
    assert c.slo == {"ttft": 0.5, "tpot": 0.05, "e2e": 3.0}
    assert c.sampling == {"temperature": 0.0, "top_p": 0.9}
    assert args.save_result and args.save_detailed and args.label == "mine"


def test_datasets_by_vllms_names() -> None:
    sharegpt = bench_cli.config_from_args(
        parse("--dataset-name", "sharegpt", "--dataset-path", "s.json")
    )
    assert (sharegpt.dataset, sharegpt.dataset_path) == ("jsonl", "s.json")
    repeated = bench_cli.config_from_args(
        parse(
            *shlex.split(
                "--dataset-name prefix_repetition --prefix-repetition-prefix-len 300 "
                "--prefix-repetition-suffix-len 40 --prefix-repetition-num-prefixes 3 "
                "--prefix-repetition-output-len 9"
            )
        )
    )
    assert (repeated.dataset, repeated.prefix_len, repeated.input_len) == ("shared-prefix", 300, 40)
    assert (repeated.num_groups, repeated.output_len) == (3, 9)
    shared = bench_cli.config_from_args(parse("--random-prefix-len", "64", "--input-len", "10"))
    assert (shared.dataset, shared.num_groups, shared.prefix_len) == ("shared-prefix", 1, 64)
    ours = bench_cli.config_from_args(parse("--dataset-name", "mooncake", "--dataset-path", "t"))
    assert ours.dataset == "mooncake"


def test_the_base_url_wins_over_host_and_port_and_endpoints_take_paths() -> None:
    c = bench_cli.config_from_args(parse("--base-url", "http://a:1", "--port", "9"))
    assert c.base_url == "http://a:1"
    assert bench_cli.config_from_args(parse("--port", "9")).base_url == "http://127.0.0.1:9"
    assert bench_cli.config_from_args(parse("--endpoint", "/v1/completions")).endpoint == (
        "completions"
    )
    assert bench_cli.config_from_args(parse("--backend", "vllm")).endpoint == "completions"


def test_served_model_name_is_sent_and_model_names_the_tokenizer() -> None:
    c = bench_cli.config_from_args(parse("--model", "/models/llama", "--served-model-name", "l"))
    assert (c.model, c.tokenizer) == ("l", "/models/llama")


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--dataset-name", "burstgpt"], "vLLM's dataset 'burstgpt' is not one"),
        (["--backend", "tgi"], "OpenAI-compatible servers only"),
        (["--backend", "openai", "--endpoint", "chat"], "calls the completions API, not chat"),
        (["--goodput", "ttft=500"], "expected KEY:MILLISECONDS"),
        (["--random-prefix-len", "5", "--dataset", "jsonl"], "for --dataset-name random"),
    ],
)
def test_contradictions_are_refused(argv: list[str], why: str) -> None:
    with pytest.raises(BenchConfigError, match=why):
        bench_cli.config_from_args(parse(*argv))


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--profile"], "vLLM's --profile is not supported here: baton serves no profiler"),
        (["--ramp-up-strategy", "linear"], "--ramp-up-strategy is not supported"),
        (["--endpoint", "/v1/embeddings"], "expected one of completions, chat"),
        (["--percentile-metrics", "ttft,foo"], "expected a comma-separated list"),
        (["--metric-percentiles", "0"], "percentiles in \\(0, 100\\]"),
        (["--tokenizer-mode", "slow"], "invalid choice"),
    ],
)
def test_flags_we_cannot_honour_stop_the_parse(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
    assert re.search(why, " ".join(capsys.readouterr().err.split()))


def test_the_sweep_knows_vllms_names_of_its_workload_flags() -> None:
    args = cli.build_parser("bench").parse_args(
        ["bench", "pd-sweep", "--num-prompts", "5", "--random-input-len", "33"]
    )
    sweep = bench_cli.sweep_config(args)
    assert (sweep.bench.num_requests, sweep.bench.input_len) == (5, 33)


def test_a_sweep_speeds_a_trace_up_and_gives_each_rate_fresh_prompts() -> None:
    args = cli.build_parser("bench").parse_args(
        ["bench", "pd-sweep", "--dataset", "mooncake", "--dataset-path", "t.jsonl",
         "--rates", "1,4", "--time-scale", "0.5", "--seed", "7"]
    )  # fmt: skip
    sweep = bench_cli.sweep_config(args)
    first, second = (sweep.point_config("http://h:1", rate) for rate in (1.0, 4.0))
    assert (first.time_scale, second.time_scale) == (0.5, 0.125)
    assert (first.seed, second.seed) == (7, 8)  # the second run misses the first's cache
    assert first.base_url == "http://h:1" and sweep.at(4.0) == "trace x4"
    rated = bench_cli.sweep_config(
        cli.build_parser("bench").parse_args(["bench", "pd-sweep", "--rates", "2,3"])
    )
    point = rated.point_config("http://h:1", 3.0)
    assert (point.request_rate, point.seed, rated.at(3.0)) == (3.0, 1, "3 req/s")


def test_a_trace_refuses_a_request_rate() -> None:
    with pytest.raises(BenchConfigError, match="the request rate does not apply"):
        bench_cli.config_from_args(
            parse("--dataset", "mooncake", "--dataset-path", "t", "--request-rate", "3")
        )
