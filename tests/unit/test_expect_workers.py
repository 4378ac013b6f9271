"""`--expect-workers`: the router's flag (and its environment variable), and `baton up`
telling the router its shape and naming each worker after its process."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.services import cli, launcher_config
from baton.services.router.config import WorkerCounts
from baton.services.router.main import config_from_args


def parse_router(argv: list[str]) -> WorkerCounts | None:
    parser = cli.build_parser("router")
    cli.apply_env_defaults(parser)
    return config_from_args(parser.parse_args(["router", *argv])).expect_workers


def test_counts_read_back_what_they_write() -> None:
    counts = WorkerCounts.parse(" prefill=1, decode=2")
    assert counts == WorkerCounts(prefill=1, decode=2)
    assert WorkerCounts.parse(str(counts)) == counts
    assert WorkerCounts.parse("") is None
    assert counts.missing({"prefill": 1, "decode": 1}) == {"decode": 1}
    assert counts.missing({"prefill": 2, "decode": 2}) == {}


@pytest.mark.parametrize("text", ["decode", "gpu=1", "decode=-1", "decode=1,decode=2", "both=x"])
def test_a_bad_count_is_refused_with_the_roles_named(text: str) -> None:
    with pytest.raises(ValueError, match="prefill, decode"):
        WorkerCounts.parse(text)


def test_the_router_flag_and_its_environment_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_router([]) is None  # no expectation: /health shows none
    assert parse_router(["--expect-workers", "both=4"]) == WorkerCounts(both=4)
    monkeypatch.setenv("BATON_EXPECT_WORKERS", "prefill=2,decode=1")
    assert parse_router([]) == WorkerCounts(prefill=2, decode=1)
    assert parse_router(["--expect-workers", "both=1"]) == WorkerCounts(both=1)  # flag wins
    with pytest.raises(SystemExit):
        parse_router(["--expect-workers", "gpu=1"])
    assert "--expect-workers" in capsys.readouterr().err


def test_up_tells_the_router_its_shape_and_names_workers_after_processes(
    tiny_model: Path,
) -> None:
    parser = cli.build_parser("up")
    argv = ["up", "--model", str(tiny_model), "--prefill", "1", "--decode", "2"]
    plan = launcher_config.plan_cluster(parser.parse_args(argv))
    router = config_from_args(cli.build_parser("router").parse_args(plan.processes[-1].argv))
    assert router.expect_workers == WorkerCounts(prefill=1, decode=2)
    assert sorted(plan.workers.values()) == ["decode-0", "decode-1", "prefill-0"]
    for process in plan.processes:
        if process.worker_id is None:
            continue
        assert process.worker_id.startswith(process.name + "-")
        worker = cli.build_parser(process.argv[0]).parse_args(process.argv)
        assert worker.worker_id == process.worker_id  # the id it registers under
    again = launcher_config.plan_cluster(parser.parse_args(argv))
    assert set(again.workers).isdisjoint(plan.workers)  # one launch's ids are its own
    aggregated = launcher_config.plan_cluster(
        parser.parse_args(["up", "--model", str(tiny_model), "--workers", "3"])
    )
    assert aggregated.router.expect_workers == WorkerCounts(both=3)
