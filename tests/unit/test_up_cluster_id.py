"""`baton up` knows its own router by the cluster id it gave it (issue #42 item 7): a
router of another cluster answering on the same address never makes it say "up"."""

from __future__ import annotations

from pathlib import Path

from baton.services import cli, launcher, launcher_config


def test_up_waits_for_its_own_router_not_one_that_answers_on_its_port(tiny_model: Path) -> None:
    parser = cli.build_parser("up")
    cli.apply_env_defaults(parser)
    plan = launcher_config.plan_cluster(parser.parse_args(["up", "--model", str(tiny_model)]))
    ours = plan.router.cluster_id
    assert ours and ours in plan.processes[-1].argv  # the router is told it
    everyone = {"worker_ids": list(plan.workers), "status": "ok"}
    assert launcher._waiting_for(plan, (200, {**everyone, "cluster_id": ours})) is None
    for other in ("someone-else", None):
        waiting = launcher._waiting_for(plan, (200, {**everyone, "cluster_id": other}))
        assert waiting is not None and "another cluster's router" in waiting
    again = launcher_config.plan_cluster(parser.parse_args(["up", "--model", str(tiny_model)]))
    assert again.router.cluster_id != ours
