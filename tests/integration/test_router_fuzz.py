"""Schemathesis over the router's own /openapi.json: generated requests, valid and not,
to every operation; none may be answered with a 5xx. The router runs under uvicorn with
fake workers, so the whole path (validation, preparation, dispatch, streaming) is used."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings

from baton.benchmarks.fake_worker import FakeBehavior, FakeWorker
from baton.common.models.tiny import default_model_path
from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.httpserve import bind_socket
from baton.services.router.app import create_app
from baton.services.router.config import RouterConfig

pytestmark = pytest.mark.timeout(300)

EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    """A router with a fake prefill/decode pair, served by uvicorn on its own thread."""
    started = threading.Event()
    stop = threading.Event()
    url: list[str] = []
    tokenizer = Tokenizer.load(default_model_path())

    async def serve() -> None:
        workers = [FakeWorker(f"{r}0", role, FakeBehavior()) for r, role in (
            ("p", pb.PREFILL), ("d", pb.DECODE))]  # fmt: skip
        for w in workers:
            await w.start()
        layout = pb.KVLayout(model="tiny", page_size=1, dtype="float32", num_layers=2)
        app = create_app(RouterConfig(), [w.info(layout) for w in workers], tokenizer=tokenizer)
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        url.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.should_exit = True
        await task
        for w in workers:
            await w.stop()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(60), "the router did not start"
    try:
        yield url[0]
    finally:
        stop.set()
        thread.join(30)


def _api_description() -> dict[str, object]:
    """The router's /openapi.json (the same document the server serves), read from the app
    at collection time: schemathesis makes one test per operation from it."""
    app = create_app(RouterConfig(), tokenizer=Tokenizer.load(default_model_path()))
    return app.openapi()


# Valid requests and invalid ones (wrong types, out-of-range numbers, missing fields).
schema = schemathesis.openapi.from_dict(
    _api_description(), config=schemathesis.Config.from_str('[generation]\nmode = "all"\n')
)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples on every run: a failure reproduces
)
def test_no_request_is_answered_with_a_server_error(
    case: schemathesis.Case, router_url: str
) -> None:
    response = case.call(base_url=router_url, timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {str(case.body)[:500]}"
    )
