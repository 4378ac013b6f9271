"""deploy/compose/compose.observe.yml: Prometheus and Grafana on top of the file that runs
the router, rendered with `docker compose config` as test_deploy_compose renders the rest.
(The dashboard's queries against a real Prometheus: test_observe_cluster.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration.test_deploy_compose import (
    DEPLOY,
    TOKEN,
    _model,
    _refused,
    _render,
    compose,
)

__all__ = ["compose"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)

PASSWORD = {"BATON_GRAFANA_ADMIN_PASSWORD": "test-password"}


@pytest.mark.parametrize("base", ["docker-compose.yml", "compose.control.yml"])
def test_prometheus_and_grafana_join_the_router_host(compose: list[str], base: str) -> None:
    model = _model(compose, [base, "compose.observe.yml"], **TOKEN, **PASSWORD, BATON_API_KEY="k")
    services = model["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]

    mounts = {v["target"]: Path(v["source"]) for v in prometheus["volumes"] if "source" in v}
    config_file = mounts["/etc/prometheus/prometheus.yml"]
    assert config_file == DEPLOY / "prometheus" / "prometheus.yml"
    (job,) = yaml.safe_load(config_file.read_text())["scrape_configs"]
    ((host, port),) = [t.split(":") for t in job["static_configs"][0]["targets"]]
    assert host in services and services[host]["environment"]["BATON_PORT"] == port
    # The router's API key reaches the file Prometheus sends as its bearer token.
    (secret,) = prometheus["configs"]
    assert secret["target"] == job["authorization"]["credentials_file"]
    assert model["configs"][secret["source"]]["content"] == "k"

    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if "source" in v}
    provisioning = mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "baton.yml").read_text())[
        "providers"
    ]
    assert mounts[provider["options"]["path"] + "/baton.json"] == DEPLOY / "grafana" / "baton.json"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"
    for service in (prometheus, grafana):  # loopback only, as the router is by default
        assert {p["host_ip"] for p in service["ports"]} == {"127.0.0.1"}


def test_grafana_needs_an_admin_password(compose: list[str]) -> None:
    out = _render(compose, ["docker-compose.yml", "compose.observe.yml"], **TOKEN)
    assert _refused(out) and "BATON_GRAFANA_ADMIN_PASSWORD" in out.stderr
