"""deploy/compose and deploy/docker: the files an operator deploys with.

Every compose file is rendered with `docker compose config` (the client alone; no engine
is needed), with .env.example as the env file, and the rendered model is checked for what
the deployment relies on: workers that scale, settings that reach them, required settings
that are refused when missing. The checks that need no docker (every variable documented,
every file the image copies present) always run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from baton.common.models.tiny import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "compose"
ENV_EXAMPLE = COMPOSE / ".env.example"
SINGLE_HOST = COMPOSE / "docker-compose.yml"
KERNELS = "/var/cache/baton/kernels"  # the image's kernel caches; a volume on GPU hosts
MIN_COMPOSE = (2, 24)  # `!reset`, used by the worker-host files

# What the worker-host files need (documentation addresses: nothing is contacted).
WORKER_HOST_ENV = {"BATON_REGISTRY": "192.0.2.10:7000", "BATON_ADVERTISE_HOST": "192.0.2.20"}
TOKEN = {"BATON_CLUSTER_TOKEN": "test-token"}

# Each base file alone, and each GPU override on top of every file that defines its service.
STACKS = [
    ["docker-compose.yml"],
    ["compose.control.yml"],
    ["compose.prefill.yml"],
    ["compose.decode.yml"],
    ["docker-compose.yml", "compose.prefill.gpu.yml", "compose.decode.gpu.yml"],
    ["compose.prefill.yml", "compose.prefill.gpu.yml"],
    ["compose.decode.yml", "compose.decode.gpu.yml"],
]


def _refused(out: subprocess.CompletedProcess[str]) -> bool:
    """The standalone docker-compose binary reports a missing required variable on stderr
    but may still exit 0; the docker CLI plugin exits non-zero."""
    return out.returncode != 0 or "missing a value" in out.stderr


def _compose_command() -> tuple[list[str] | None, str]:
    """The compose CLI (plugin or standalone), or None and why not."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    if not candidates:
        return None, "neither `docker` nor `docker-compose` is installed"
    found = []
    for cmd in candidates:
        out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        match = re.match(r"v?(\d+)\.(\d+)", out.stdout.strip())
        if out.returncode == 0 and match:
            version = (int(match[1]), int(match[2]))
            if version >= MIN_COMPOSE:
                return cmd, ""
            found.append(f"{' '.join(cmd)} {out.stdout.strip()}")
    have = ", ".join(found) or "no compose plugin for the docker client"
    return None, f"needs Docker Compose v{MIN_COMPOSE[0]}.{MIN_COMPOSE[1]}+ ({have})"


@pytest.fixture(scope="module")
def compose() -> list[str]:
    cmd, why = _compose_command()
    if cmd is None:
        pytest.skip(why)
    return cmd


def _render(compose: list[str], files: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    # Only the variables given here and the env file count, never the caller's.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "COMPOSE_"))}
    args = [*compose, "--env-file", str(ENV_EXAMPLE)]
    for name in files:
        args += ["-f", str(COMPOSE / name)]
    return subprocess.run(
        [*args, "config", "--format", "json"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _model(compose: list[str], files: list[str], **env: str) -> dict[str, Any]:
    out = _render(compose, files, **env)
    assert out.returncode == 0, out.stderr
    model: dict[str, Any] = json.loads(out.stdout)
    return model


@pytest.mark.parametrize("files", STACKS, ids=["+".join(s) for s in STACKS])
def test_every_compose_file_renders(compose: list[str], files: list[str]) -> None:
    model = _model(compose, files, **TOKEN, **WORKER_HOST_ENV)
    for name, service in model["services"].items():
        assert service["image"], name
        assert service["environment"]["BATON_CLUSTER_TOKEN"] == "test-token", name
        assert service["healthcheck"]["test"] == ["CMD", "baton-healthcheck"], name


def test_single_host_workers_scale(compose: list[str]) -> None:
    services = _model(compose, ["docker-compose.yml"], **TOKEN)["services"]
    assert set(services) == {"bootstrap", "router", "prefill", "decode"}
    for role in ("prefill", "decode"):
        worker = services[role]
        # `--scale` needs replicas that differ: no fixed name, no fixed host port
        assert "container_name" not in worker and not worker.get("ports"), role
        env = worker["environment"]
        assert env["BATON_HOST"] == env["BATON_ADVERTISE_HOST"] == "auto"
        assert env["BATON_REGISTRY"] == "bootstrap:7000"
        assert env["BATON_MODEL"] == worker["volumes"][0]["target"]
        assert worker["command"] == [role]
    (router_port,) = services["router"]["ports"]
    assert (router_port["host_ip"], router_port["published"]) == ("127.0.0.1", "8000")
    assert "ports" not in services["bootstrap"]  # internal on one host


def test_settings_reach_the_workers(compose: list[str]) -> None:
    services = _model(
        compose,
        ["docker-compose.yml"],
        **TOKEN,
        BATON_PAGE_SIZE="16",
        BATON_TRANSFER_BACKEND="ucx",
        BATON_MODEL_DIR="/srv/models/qwen",
        BATON_MODEL_NAME="qwen",
        BATON_API_KEY="k",
        BATON_ROUTER_PORT="18000",
    )["services"]
    for role in ("prefill", "decode"):
        env = services[role]["environment"]
        assert (env["BATON_PAGE_SIZE"], env["BATON_TRANSFER_BACKEND"]) == ("16", "ucx")
        (volume,) = services[role]["volumes"]
        assert (volume["type"], volume["source"], volume["target"]) == (
            "bind",
            "/srv/models/qwen",
            "/models/qwen",
        )
        assert volume["read_only"] and env["BATON_MODEL"] == "/models/qwen"
    router = services["router"]
    assert router["environment"]["BATON_API_KEY"] == "k"
    assert router["environment"]["BATON_MODEL"] == "/models/qwen"
    assert router["ports"][0]["published"] == "18000"


def test_cluster_token_is_required(compose: list[str]) -> None:
    for files in (["docker-compose.yml"], ["compose.control.yml"], ["compose.decode.yml"]):
        out = _render(compose, files, **WORKER_HOST_ENV)
        assert _refused(out), files
        assert "BATON_CLUSTER_TOKEN" in out.stderr, files


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_host_files(compose: list[str], role: str) -> None:
    for missing in WORKER_HOST_ENV:
        given = {k: v for k, v in WORKER_HOST_ENV.items() if k != missing}
        out = _render(compose, [f"compose.{role}.yml"], **TOKEN, **given)
        assert _refused(out) and missing in out.stderr, missing

    (service,) = _model(compose, [f"compose.{role}.yml"], **TOKEN, **WORKER_HOST_ENV)[
        "services"
    ].values()
    env = service["environment"]
    assert service["network_mode"] == "host"
    assert "depends_on" not in service  # the bootstrap lives on another host
    assert env["BATON_REGISTRY"] == "192.0.2.10:7000"
    assert env["BATON_HOST"] == env["BATON_ADVERTISE_HOST"] == "192.0.2.20"
    assert env["BATON_HEALTHCHECK_PORT"] == env["BATON_METRICS_PORT"]


def test_prefill_and_decode_hosts_can_share_a_machine(compose: list[str]) -> None:
    ports = []
    for role in ("prefill", "decode"):
        (service,) = _model(compose, [f"compose.{role}.yml"], **TOKEN, **WORKER_HOST_ENV)[
            "services"
        ].values()
        ports += [
            service["environment"]["BATON_PORT"],
            service["environment"]["BATON_METRICS_PORT"],
        ]
    assert len(set(ports)) == len(ports), ports


def test_control_host_publishes_the_bootstrap(compose: list[str]) -> None:
    services = _model(compose, ["compose.control.yml"], **TOKEN)["services"]
    assert set(services) == {"bootstrap", "router"}
    (port,) = services["bootstrap"]["ports"]
    assert (port["target"], port["published"]) == (7000, "7000")


def test_gpu_override_gives_each_worker_its_device(compose: list[str]) -> None:
    files = ["docker-compose.yml", "compose.prefill.gpu.yml", "compose.decode.gpu.yml"]
    services = _model(compose, files, **TOKEN, BATON_PREFILL_GPU="0", BATON_DECODE_GPU="1")[
        "services"
    ]
    for role, gpu in (("prefill", "0"), ("decode", "1")):
        (device,) = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"]
        assert services[role]["environment"]["BATON_DEVICE"] == "cuda"
        # the compiled kernels outlive the container, and the model is still mounted
        targets = {v["target"]: v for v in services[role]["volumes"]}
        assert targets[KERNELS]["type"] == "volume", role
        assert services[role]["environment"]["BATON_MODEL"] in targets, role


def test_kernel_caches_point_into_the_kernels_volume() -> None:
    # flashinfer keeps its JIT cache under FLASHINFER_WORKSPACE_BASE, Triton in
    # TRITON_CACHE_DIR: both must lie in the folder the GPU files mount a volume on,
    # which the image creates for its user (a new volume takes that folder's owner)
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert f"FLASHINFER_WORKSPACE_BASE={KERNELS} " in dockerfile
    assert f"TRITON_CACHE_DIR={KERNELS}/triton " in dockerfile
    assert re.search(rf"mkdir -p [^\n]*{KERNELS}", dockerfile)
    assert re.search(rf"chown baton:baton [^\n]*{KERNELS}", dockerfile)


# ---- checks that need no docker ----------------------------------------------------------


def _variables_read(text: str) -> set[str]:
    return set(re.findall(r"\$\{([A-Z0-9_]+)", text))


def test_env_example_documents_every_variable() -> None:
    documented = set(re.findall(r"^([A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.M))
    read = set().union(*(_variables_read(f.read_text()) for f in COMPOSE.glob("*.yml")))
    assert read - documented == set(), "read by the compose files, missing in .env.example"
    assert documented - read == set(), "in .env.example, read by no compose file"


def test_default_model_is_the_one_the_image_builds() -> None:
    # The image bakes the tiny model at /models/<DEFAULT_MODEL_NAME>; the compose default
    # mounts (and names) exactly that folder.
    defaults = set(re.findall(r"\$\{BATON_MODEL_NAME:-([^}]+)\}", SINGLE_HOST.read_text()))
    assert defaults == {DEFAULT_MODEL_NAME}
    assert f"BATON_MODEL_NAME={DEFAULT_MODEL_NAME}\n" in ENV_EXAMPLE.read_text()


def test_image_copies_only_files_that_exist_and_are_not_ignored() -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().split()
    sources = [
        src
        for line in dockerfile.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    ]
    assert sources
    root = DEPLOY.parent
    for src in sources:
        assert (root / src).exists(), src
        assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is excluded from the context"
