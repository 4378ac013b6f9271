"""Fixtures shared by integration test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton.common.models.tiny import default_model_path
from baton.common.tokenizer import Tokenizer
from tests.integration.etcd_server import NOT_INSTALLED, EtcdServer, etcd_binary
from tests.integration.router_api import TEXT


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The built-in tiny model's tokenizer."""
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def script(tokenizer: Tokenizer) -> list[int]:
    """The token ids of `router_api.TEXT`, which the router tests' fake workers generate."""
    return tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the whole session; tests use key prefixes of their own, and a test
    that stops it starts it again before it ends."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip(NOT_INSTALLED)
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data", binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> EtcdServer:
    """The session's etcd, running (a test that failed while it was stopped may have left
    it so)."""
    if etcd_server.proc is None:
        etcd_server.start()
    return etcd_server
