"""deploy/kubernetes: the kustomize base an operator applies.

Offline, with no cluster and no kubectl: the kustomizations are rendered here (they use
`resources` only, which the first test enforces, so this rendering is kustomize's), every
object is validated against the Kubernetes OpenAPI schemas that `kubernetes-validate` ships
(strict: an unknown field is an error) for the oldest and newest Kubernetes we claim, and the
rendered objects are checked for what the deployment relies on: prefill and decode scale
apart, GPUs are requested, probes hit real endpoints on real ports, services select real
pods, the cluster token comes from a Secret, and every BATON_* variable is a flag of the
command that reads it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from baton.services.cli import build_parser, env_name

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
VERSIONS = ["1.29.0", "1.35.0"]  # the oldest and newest Kubernetes the manifests claim
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources"}
WORKER_ROLES = ("prefill", "decode")


def render(folder: Path) -> Iterator[dict[str, Any]]:
    """The objects `kubectl apply -k folder` would create."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for entry in kustomization["resources"]:
        path = folder / entry
        if path.is_dir():
            yield from render(path)
        else:
            yield from (doc for doc in yaml.safe_load_all(path.read_text()) if doc)


def objects(folder: Path = KUBERNETES) -> dict[tuple[str, str], dict[str, Any]]:
    rendered = list(render(folder))
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    assert len(by_key) == len(rendered), "two objects share a kind and name"
    return by_key


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(workload)["containers"]
    return dict(only)


def baton_workloads() -> dict[str, dict[str, Any]]:
    """The router and worker Deployments, by the baton command they run."""
    out = {}
    for (kind, _), o in objects().items():
        if kind == "Deployment":
            out[container(o)["args"][0]] = o
    return out


def test_kustomizations_use_only_what_this_test_renders() -> None:
    for path in KUBERNETES.rglob("kustomization.yaml"):
        keys = set(yaml.safe_load(path.read_text()))
        assert keys <= KUSTOMIZATION_KEYS, f"{path}: {keys - KUSTOMIZATION_KEYS} not validated"
    # every manifest is part of the default kustomization; none is forgotten
    listed = {p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml"}
    rendered_from = set()
    for path in KUBERNETES.rglob("kustomization.yaml"):
        rendered_from |= {path.parent / r for r in yaml.safe_load(path.read_text())["resources"]}
    assert listed <= rendered_from


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(version: str) -> None:
    for (kind, name), obj in objects().items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{name} on Kubernetes {version}: {e.message} at {e.path}")


def test_base_without_etcd_is_complete_too() -> None:
    base = objects(KUBERNETES / "base")
    assert {kind for kind, _ in base} == {"ConfigMap", "Deployment", "Service"}
    assert not any(name.startswith("baton-etcd") for _, name in base)


def test_prefill_and_decode_are_separate_deployments_on_gpus() -> None:
    workloads = baton_workloads()
    assert set(workloads) == {"router", *WORKER_ROLES}
    for role in WORKER_ROLES:
        limits = container(workloads[role])["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1, role
        labels = workloads[role]["spec"]["selector"]["matchLabels"]
        assert labels["app.kubernetes.io/component"] == role  # scaled on its own
    assert "nvidia.com/gpu" not in container(workloads["router"])["resources"]["limits"]


def test_probes_hit_health_on_declared_ports() -> None:
    for command, workload in baton_workloads().items():
        c = container(workload)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["path"] == "/health", command
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in ports, (command, probe)
        env = {e["name"]: e.get("value") for e in c["env"]}
        if command == "router":
            assert ports["http"] == int(env["BATON_PORT"])
            # A router waiting for workers answers 503 on /health: not ready, but alive.
            assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"
        else:
            assert ports["metrics"] == int(env["BATON_METRICS_PORT"])
            assert ports["grpc"] == int(env["BATON_PORT"])
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["startupProbe"]["httpGet"]["path"] == "/health"
            # draining (up to 60 s) fits in the grace period
            assert pod_spec(workload)["terminationGracePeriodSeconds"] > 60


def test_services_select_pods_and_target_their_ports() -> None:
    everything = objects()
    pods = [
        o["spec"]["template"] for (kind, _), o in everything.items() if kind != "Service"
        if "template" in o.get("spec", {})
    ]  # fmt: skip
    for (kind, name), service in everything.items():
        if kind != "Service":
            continue
        selector = service["spec"]["selector"]
        matching = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert matching, f"Service {name} selects no pod"
        port_names = {p["name"] for t in matching for p in t["spec"]["containers"][0]["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name}: {port['targetPort']}"


def test_secrets_come_from_the_secret_never_from_a_value() -> None:
    for command, workload in baton_workloads().items():
        env = {e["name"]: e for e in container(workload)["env"]}
        token = env["BATON_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "baton-secrets", "key": "cluster-token"}, command
        for secret in ("BATON_API_KEY", "BATON_REGISTRY_PASSWORD"):
            assert secret not in env or "value" not in env[secret], command
    config = objects()[("ConfigMap", "baton-config")]["data"]
    assert not {"BATON_CLUSTER_TOKEN", "BATON_API_KEY", "BATON_REGISTRY_PASSWORD"} & set(config)


def _flags_env(command: str) -> set[str]:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        command
    ]
    return {env_name(a.dest) for a in sub._actions if a.option_strings}


def test_every_setting_is_a_flag_of_the_command_that_reads_it() -> None:
    workloads = baton_workloads()
    readers = {command: _flags_env(command) for command in workloads}
    config = objects()[("ConfigMap", "baton-config")]["data"]
    for key in config:
        assert any(key in flags for flags in readers.values()), f"ConfigMap {key}: no flag"
    for command, workload in workloads.items():
        for e in container(workload)["env"]:
            if e["name"] != "BATON_REGISTRY_PASSWORD":  # read from the environment only
                assert e["name"] in readers[command], f"{command}: {e['name']} is no flag"


def test_the_registry_is_the_etcd_service() -> None:
    everything = objects()
    registry = everything[("ConfigMap", "baton-config")]["data"]["BATON_REGISTRY"]
    service = everything[("Service", "baton-etcd")]
    assert registry.startswith(f"etcd://baton-etcd:{service['spec']['ports'][0]['port']}/")
    etcd = everything[("StatefulSet", "baton-etcd")]
    assert etcd["spec"]["volumeClaimTemplates"], "etcd keeps its data across restarts"
