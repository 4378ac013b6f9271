"""The dependency floors in pyproject.toml are versions the committed gRPC stubs accept.

protoc writes the protobuf version it was built with into common/rpc/baton_pb2.py, and the
stub refuses (at import) any runtime older than that; grpcio does the same in
baton_pb2_grpc.py. A floor below those lets pip keep an install no process can start with.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib
from google.protobuf import runtime_version
from grpc._utilities import first_version_is_lower
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
RPC = ROOT / "common" / "rpc"


def floor(package: str) -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for text in dependencies:
        requirement = Requirement(text)
        if requirement.name == package:
            [spec] = [s for s in requirement.specifier if s.operator == ">="]
            return spec.version
    raise AssertionError(f"{package} is not a dependency")


def gencode_call() -> ast.Call:
    tree = ast.parse((RPC / "baton_pb2.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == (
            "ValidateProtobufRuntimeVersion"
        ):
            return node
    raise AssertionError("baton_pb2.py checks no runtime version")


def test_the_stubs_load_under_the_declared_protobuf_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    major, minor, patch = (int(part) for part in [*floor("protobuf").split("."), "0", "0"][:3])
    monkeypatch.setattr(runtime_version, "MAJOR", major)
    monkeypatch.setattr(runtime_version, "MINOR", minor)
    monkeypatch.setattr(runtime_version, "PATCH", patch)
    call = gencode_call()
    args = [ast.literal_eval(arg) for arg in call.args[1:]]  # the domain is an attribute
    runtime_version.ValidateProtobufRuntimeVersion(runtime_version.Domain.PUBLIC, *args)


def test_the_stubs_load_under_the_declared_grpcio_floor() -> None:
    source = (RPC / "baton_pb2_grpc.py").read_text()
    [generated] = [
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "GRPC_GENERATED_VERSION"
    ]
    assert not first_version_is_lower(floor("grpcio"), generated)


def test_the_check_catches_a_floor_below_the_gencode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_version, "PATCH", 0)  # e.g. 7.35.0 under 7.35.1 stubs
    monkeypatch.setattr(runtime_version, "MINOR", 35)
    monkeypatch.setattr(runtime_version, "MAJOR", 7)
    with pytest.raises(runtime_version.VersionError):
        runtime_version.ValidateProtobufRuntimeVersion(
            runtime_version.Domain.PUBLIC, 7, 35, 1, "", "x"
        )
