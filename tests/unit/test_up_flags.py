"""`baton up` checks every flag before it starts anything, and hands each process exactly
the configuration it parsed (the worker's flags are declared once, from the configs)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.common.options import ConfigError
from baton.common.rpc.auth import short_token_refusal, token_refusal
from baton.services import cli, launcher_config, supervisor
from baton.services.worker.config import worker_config

# An invalid value for each flag of `baton up` (with any flag it needs to be judged).
BAD: dict[str, list[str]] = {
    "--prefill": ["--prefill", "0"],
    "--decode": ["--decode", "two"],
    "--workers": ["--workers", "1", "--prefill", "1"],
    "--host": ["--host", "a host"],
    "--bootstrap-port": ["--bootstrap-port", "70000"],
    "--gpus": ["--gpus", "0;1"],
    "--prefill-tp": ["--prefill-tp", "0"],
    "--decode-tp": ["--decode-tp", "x"],
    "--cluster-token": ["--cluster-token", " spaced "],
    "--startup-timeout": ["--startup-timeout", "0"],
    "--log-dir": ["--log-dir", __file__],
    "--log-level": ["--log-level", "loud"],
    "--port": ["--port", "65536"],
    "--policy": ["--policy", "nope"],
    "--prefill-policy": ["--prefill-policy", "nope"],
    "--decode-policy": ["--decode-policy", "nope"],
    "--placement": ["--placement", "nearest"],
    "--ttft-slo": ["--ttft-slo", "0"],
    "--tpot-slo": ["--tpot-slo", "-0.02"],
    "--host-kv-tokens": ["--host-kv-tokens", "-1"],
    "--host-kv-write": ["--host-kv-write", "sometimes"],
    "--api-key": ["--api-key", "tab\there"],
    "--admin-api-key": ["--admin-api-key", " padded"],
    "--tool-call-parser": ["--tool-call-parser", "regex"],
    "--max-concurrent-requests": ["--max-concurrent-requests", "-1"],
    "--max-queued-requests": ["--max-queued-requests", "-1"],
    "--queue-timeout": ["--queue-timeout", "0"],
    "--max-body-bytes": ["--max-body-bytes", "0"],
    "--body-timeout": ["--body-timeout", "-1"],
    "--header-timeout": ["--header-timeout", "0"],
    "--stop-grace": ["--stop-grace", "0"],
    "--request-timeout": ["--request-timeout", "soon"],
    "--lease-ttl": ["--lease-ttl", "0"],
    "--registry": ["--registry", "no-port"],
    "--registry-username": ["--registry-username", "u"],
    "--registry-ca-file": ["--registry-ca-file", "ca.pem"],
    "--registry-cert-file": ["--registry-cert-file", "c.pem"],
    "--registry-key-file": ["--registry-key-file", "k.pem"],
    "--registry-tls-server-name": ["--registry-tls-server-name", "etcd"],
    "--model": ["--model", "/no/such/model"],
    "--tp": ["--tp", "0"],
    "--dtype": ["--dtype", "float8"],
    "--device": ["--device", "gpu"],
    "--load-format": ["--load-format", "pickle"],
    "--seed": ["--seed", "1.5"],
    "--page-size": ["--page-size", "0"],
    "--max-total-tokens": ["--page-size", "16", "--max-total-tokens", "8"],
    "--gpu-memory-fraction": ["--gpu-memory-fraction", "1.5"],
    "--stream-interval": ["--stream-interval", "0"],
    "--kv-events": ["--kv-events", "maybe"],
    "--kv-events-backlog": ["--kv-events-backlog", "0"],
    "--max-running-requests": ["--max-running-requests", "0"],
    "--chunked-prefill-size": ["--chunked-prefill-size", "-4"],
    "--max-prefill-tokens": ["--max-prefill-tokens", "0"],
    "--schedule-policy": ["--schedule-policy", "lifo"],
    "--decode-reserve-tokens": ["--decode-reserve-tokens", "-1"],
    "--overlap-max-step-tokens": ["--overlap-max-step-tokens", "-1"],
    "--attention-backend": ["--attention-backend", "nope"],
    "--prefill-attention-backend": ["--prefill-attention-backend", "nope"],
    "--decode-attention-backend": ["--decode-attention-backend", "nope"],
    "--cuda-graph-max-bs": ["--cuda-graph-max-bs", "0"],
    "--prefill-graph-max-tokens": ["--prefill-graph-max-tokens", "-1"],
    "--piecewise-graph-max-tokens": ["--piecewise-graph-max-tokens", "-1"],
    "--transfer-backend": ["--transfer-backend", "carrier-pigeon"],
    "--room-timeout": ["--room-timeout", "-1"],
    "--transfer-fault": ["--transfer-backend", "fake", "--transfer-fault", "explode"],
    "--otlp-traces-endpoint": ["--otlp-traces-endpoint", "collector:4317"],
    "--otlp-traces-sample-ratio": ["--otlp-traces-sample-ratio", "1.5"],
}

FREE_TEXT = {"--served-model-name"}  # any name clients are to use is valid


def up_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser("up")
    cli.apply_env_defaults(parser)
    return parser


def value_flags() -> list[str]:
    sub = next(a for a in up_parser()._actions if a.dest == "command").choices["up"]  # type: ignore[union-attr]
    return [a.option_strings[0] for a in sub._actions if a.option_strings and a.nargs != 0]


def test_every_flag_that_takes_a_value_has_a_bad_value_here() -> None:
    assert sorted(value_flags()) == sorted([*BAD, *FREE_TEXT])


@pytest.mark.parametrize("flag", sorted(BAD))
def test_a_bad_value_stops_up_before_any_process(
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tiny_model: Path,
) -> None:
    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(supervisor.subprocess, "Popen", no_process)
    argv = ["up", *BAD[flag]]
    if "--model" not in argv:
        argv += ["--model", str(tiny_model)]
    start = time.monotonic()
    with caplog.at_level(logging.ERROR):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse
            rc = e.code  # type: ignore[assignment]
    assert rc == 2
    assert time.monotonic() - start < 2.0
    assert flag in capsys.readouterr().err + caplog.text


def test_up_refuses_a_bad_value_in_a_fraction_of_a_second() -> None:
    """As a user runs it: a fresh process, no torch import on the way to the error."""
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "baton.services.cli", "up", "--attention-backend", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 2
    assert "--attention-backend" in out.stderr and "nope" in out.stderr
    assert elapsed < 5.0, f"took {elapsed:.1f}s"


def test_up_hands_every_worker_flag_to_its_workers(tiny_model: Path) -> None:
    """Each worker's command line parses back into the config `baton up` validated."""
    argv = [
        "up",
        "--model",
        str(tiny_model),
        "--seed",
        "7",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "32",
        "--max-prefill-tokens",
        "999",
        "--enable-mixed-chunk",
        "--schedule-policy",
        "lpm",
        "--prefill-attention-backend",
        "triton",
        "--decode-reserve-tokens",
        "3",
        "--transfer-backend",
        "fake",
        "--transfer-fault",
        "delay:ms=1",
        "--kv-verify-checksum",
        "--room-timeout",
        "9",
        "--decode-radix-cache",
        "--prefill-tp",
        "2",
        "--lease-ttl",
        "2",
        "--cluster-token",
        "tok-0123456789abcdef",
        "--policy",
        "round_robin",
        "--request-timeout",
        "5",
        "--max-queued-requests",
        "7",
        "--queue-timeout",
        "3",
        "--max-body-bytes",
        "1234",
        "--header-timeout",
        "4",
        "--api-key",
        "key",
    ]
    args = up_parser().parse_args(argv)
    plan = launcher_config.plan_cluster(args)
    names = [p.name for p in plan.processes]
    assert names == ["bootstrap", "prefill-0", "decode-0", "router"]
    for process in plan.processes[1:3]:
        assert "tok-0123456789abcdef" not in process.argv  # secrets travel in the environment
        worker_parser = cli.build_parser(process.argv[0])
        parsed = worker_parser.parse_args(process.argv)
        parsed.cluster_token = "tok-0123456789abcdef"
        config = worker_config(parsed, parsed.command if parsed.command != "worker" else "both")
        engine, transfer = config.engine, config.transfer
        assert (engine.seed, engine.page_size, engine.chunked_prefill_size) == (7, 4, 32)
        assert (engine.max_prefill_tokens, engine.enable_mixed_chunk) == (999, True)
        assert (engine.schedule_policy, engine.prefill_attention_backend) == ("lpm", "triton")
        assert engine.decode_reserve_tokens == 3
        assert engine.tp_size == (2 if config.role == "prefill" else 1)
        assert engine.disable_radix_cache is False  # --decode-radix-cache reached decode
        assert (transfer.backend, transfer.fault, transfer.verify_checksum) == (
            "fake",
            "delay:ms=1",
            True,
        )
        assert (transfer.room_timeout, config.lease_ttl, config.heartbeat_interval) == (9, 2, 0.5)
        assert config.registry is not None and config.registry.url.startswith("127.0.0.1:")
    router_argv = plan.processes[-1].argv
    assert "--api-key" not in router_argv and {"tok-0123456789abcdef", "key"}.isdisjoint(
        router_argv
    )
    router = cli.build_parser("router").parse_args(router_argv)
    assert (router.policy, router.request_timeout, router.model) == (
        "round_robin",
        5.0,
        str(tiny_model),
    )
    assert (router.max_queued_requests, router.queue_timeout) == (7, 3.0)
    assert (router.max_body_bytes, router.header_timeout) == (1234, 4.0)
    assert (
        plan.env["BATON_CLUSTER_TOKEN"] == "tok-0123456789abcdef"
        and plan.env["BATON_API_KEY"] == "key"
    )


@pytest.mark.parametrize(
    "command", ["up", "worker", "prefill", "decode", "router", "bootstrap", "generate", "planner"]
)
def test_every_flag_has_help_text(command: str) -> None:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
    silent = [a.option_strings[0] for a in sub._actions if a.option_strings and not a.help]
    assert not silent, f"baton {command}: flags without help: {silent}"


def test_gpus_index_the_gpus_baton_up_itself_sees(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`CUDA_VISIBLE_DEVICES=2,3 baton up --gpus 0,1` runs on GPUs 2 and 3, as CUDA would
    number them; each worker sees its own GPU first and the other after (peer copies)."""
    argv = ["up", "--model", str(tiny_model), "--prefill", "1", "--decode", "1", "--gpus", "0,1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    plan = launcher_config.plan_cluster(up_parser().parse_args(argv))
    assert [p.gpus for p in plan.processes if p.name != "router"][1:] == ["2,3", "3,2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(ValueError, match="shows 1 GPUs"):
        launcher_config.plan_cluster(up_parser().parse_args(argv))


def _fractions(plan: launcher_config.ClusterPlan) -> dict[str, float]:
    out = {}
    for p in plan.processes:
        if "--gpu-memory-fraction" in p.argv:
            out[p.name] = float(p.argv[p.argv.index("--gpu-memory-fraction") + 1])
    return out


@pytest.mark.parametrize(
    ("gpus", "want"),
    [
        (["--gpus", "0,1"], {"prefill-0": 0.88, "decode-0": 0.88}),  # a GPU each
        (["--gpus", "0"], {"prefill-0": 0.44, "decode-0": 0.44}),  # one GPU for both
        ([], {"prefill-0": 0.44, "decode-0": 0.44}),  # both on the first GPU they see
    ],
)
def test_workers_that_share_a_gpu_share_its_memory(tiny_model: Path, gpus, want) -> None:  # type: ignore[no-untyped-def]
    """Each GPU worker sizes its KV pool from its share of the GPU; two on one GPU that
    each took 88% would fail the second's start."""
    argv = ["up", "--model", str(tiny_model), "--device", "cuda", *gpus]
    assert _fractions(launcher_config.plan_cluster(up_parser().parse_args(argv))) == want
    given = launcher_config.plan_cluster(
        up_parser().parse_args([*argv, "--max-total-tokens", "8192"])
    )
    assert set(_fractions(given).values()) <= {0.88}  # a given pool size: nothing to split


def test_a_short_cluster_token_is_refused_saying_why(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A one-character token could be guessed by anyone who reaches a port: baton up, the
    router, the bootstrap and the workers each refuse one shorter than 16 bytes."""
    with caplog.at_level(logging.ERROR):
        rc = cli.main(["up", "--model", str(tiny_model), "--cluster-token", "x"])
    said = capsys.readouterr().err + caplog.text
    assert rc == 2 and "at least 16" in said and "--cluster-token" in said
    assert " x " not in said.replace("(", " ").replace(")", " ")  # the token is never shown
    for what in ("the router", "the worker", "the bootstrap"):
        refusal = token_refusal("0123456789abcde", False, what)
        assert refusal is not None and "15 bytes" in refusal and what in refusal
        assert token_refusal("0123456789abcdef", False, what) is None
    assert short_token_refusal(None, "the router") is None  # no token: --insecure's business


def test_up_with_the_planner_plans_it_against_its_router_with_an_admin_key(
    tiny_model: Path,
) -> None:
    argv = [
        "up",
        "--model",
        str(tiny_model),
        "--planner",
        "--ttft-slo",
        "0.5",
        "--tpot-slo",
        "0.03",
    ]
    plan = launcher_config.plan_cluster(up_parser().parse_args(argv))
    planner = next(p for p in plan.processes if p.name == "planner")
    assert planner.argv[:5] == ["planner", "--url", plan.url, "--slo", "ttft=0.5s,tpot=0.03s"]
    key = plan.env["BATON_ADMIN_API_KEY"]  # made for it: the router reads the same variable
    assert len(key) >= 16 and not any(key in arg for p in plan.processes for arg in p.argv)
    given = launcher_config.plan_cluster(
        up_parser().parse_args([*argv, "--admin-api-key", "a-key-of-our-own"])
    )
    assert given.env["BATON_ADMIN_API_KEY"] == "a-key-of-our-own"
    with pytest.raises(ConfigError, match="planner"):  # it changes P/D roles
        launcher_config.plan_cluster(up_parser().parse_args([*argv, "--workers", "2"]))
    plain = launcher_config.plan_cluster(up_parser().parse_args(argv[:3]))
    assert "BATON_ADMIN_API_KEY" not in plain.env
    assert all(p.name != "planner" for p in plain.processes)
