"""A worker's scheduler process, driven over its ZMQ sockets as its frontend drives it: what
an operator sees when its engine cannot start (the reason, and a process that ends rather
than hangs), and a clean stop after serving."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from baton.common.config import EngineConfig
from baton.common.protocol import (
    GenerateReq,
    OutputBatch,
    ReadyOut,
    ShutdownReq,
    decode_from_scheduler,
    encode,
)
from baton.common.sampling import SamplingParams
from baton.services.worker.config import SchedulerProcArgs
from baton.services.worker.scheduler_proc import run

pytestmark = pytest.mark.timeout(120)


class Frontend:
    """The frontend's two sockets, bound, and the scheduler process started on them."""

    def __init__(self, engine: EngineConfig, tmp_path: Path) -> None:
        to_sched, from_sched = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.bind(to_sched)
        self.pull.bind(from_sched)
        args = SchedulerProcArgs(engine, to_sched, from_sched, log_level="WARNING")
        self.proc = mp.get_context("spawn").Process(target=run, args=(args,))
        self.proc.start()

    def next_of(self, kind: type, within_s: float = 60.0) -> object:
        while self.pull.poll(int(within_s * 1000)):
            msg = decode_from_scheduler(self.pull.recv())
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} within {within_s} s")

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)
        self.ctx.destroy(linger=0)


@pytest.fixture
def frontend(tmp_path: Path) -> Iterator[list[Frontend]]:
    started: list[Frontend] = []
    yield started
    for f in started:
        f.close()


def test_an_engine_that_cannot_start_says_why_and_the_process_ends(
    tmp_path: Path, frontend: list[Frontend]
) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    f = Frontend(EngineConfig(model_path=str(empty)), tmp_path)
    frontend.append(f)
    ready = f.next_of(ReadyOut)
    assert isinstance(ready, ReadyOut) and ready.error, "the failure must reach the frontend"
    assert "not-a-model" in ready.error, ready.error  # (the folder it could not read)
    f.proc.join(20)
    assert not f.proc.is_alive(), "a scheduler that could not start must not linger"


def test_a_served_request_then_a_shutdown_ends_the_process_cleanly(
    tiny_model: Path, tmp_path: Path, frontend: list[Frontend]
) -> None:
    f = Frontend(EngineConfig(model_path=str(tiny_model)), tmp_path)
    frontend.append(f)
    ready = f.next_of(ReadyOut)
    assert isinstance(ready, ReadyOut) and not ready.error and ready.num_pages > 0
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    f.push.send(encode(GenerateReq("r1", [5, 6, 7, 8], params)))
    tokens: list[int] = []
    while True:
        batch = f.next_of(OutputBatch)
        assert isinstance(batch, OutputBatch)
        outs = [o for o in batch.items if o.rid == "r1"]
        tokens += [t for o in outs for t in o.token_ids]
        if any(o.finished for o in outs):
            assert outs[-1].finish_reason == "length" and not outs[-1].error
            break
    assert len(tokens) == 3
    f.push.send(encode(ShutdownReq()))
    f.proc.join(20)
    assert f.proc.exitcode == 0
