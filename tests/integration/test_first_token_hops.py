"""Where a short request's time goes while the scheduler computes long prompt chunks.

A scheduler process (the worker's own loop) on CPU, its steps slowed to a GPU's pace by
`BATON_STEP_SECONDS_PER_TOKEN`, driven over its ZMQ sockets as the frontend drives it: a
long prompt keeps it in long steps, and a short one arrives during one of them, with a
second long prompt right behind it that fills the short one's step and the next. What a
user would notice: the short request waits for the step in flight before the scheduler
takes it (`ingress`, at most one step), and its first token leaves as soon as its step is
processed (`emit`), not after the long step launched behind it.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
import zmq

from baton.common.config import EngineConfig
from baton.common.protocol import GenerateReq, OutputBatch, ReadyOut, decode_from_scheduler, encode
from baton.common.sampling import SamplingParams
from baton.services.worker.config import SchedulerProcArgs
from baton.services.worker.scheduler_proc import run
from tests.conftest import random_prompts

pytestmark = pytest.mark.timeout(120)

SECONDS_PER_TOKEN = 0.001
CHUNK = 512  # a chunk step takes about 0.5 s
STEP_S = CHUNK * SECONDS_PER_TOKEN
SLACK_S = 0.15  # the tiny model's own compute, and a loaded test machine
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _scenario(
    engine: EngineConfig, tmp_path: Path, lengths: list[int], short_at: float
) -> tuple[float, float, float, dict[str, float]]:
    """Prompts long-a, short and long-b (of `lengths`): short `short_at` s after long-a,
    long-b 0.03 s after short. When long-a and short were sent, when short's first token
    reached the frontend, and short's timings."""
    to_sched, from_sched = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(to_sched)
    pull.bind(from_sched)
    proc = mp.get_context("spawn").Process(
        target=run, args=(SchedulerProcArgs(engine, to_sched, from_sched, log_level="WARNING"),)
    )
    proc.start()
    try:
        long_a, short, long_b = random_prompts(lengths, vocab=2000, seed=5)
        assert pull.poll(60_000), "the scheduler did not start"
        assert isinstance(decode_from_scheduler(pull.recv()), ReadyOut)

        def send(rid: str, prompt: list[int]) -> float:
            now = time.monotonic()
            push.send(encode(GenerateReq(rid, prompt, PARAMS, received_at=now)))
            return now

        start = send("long-a", long_a)
        time.sleep(short_at)
        sent = send("short", short)
        time.sleep(0.03)
        send("long-b", long_b)
        first_at, timings = _short_outputs(pull)
    finally:
        proc.terminate()
        proc.join(10)
        ctx.destroy(linger=0)
    return start, sent, first_at, timings


def test_short_request_waits_at_most_a_step_each_way(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_STEP_SECONDS_PER_TOKEN", str(SECONDS_PER_TOKEN))
    engine = EngineConfig(model_path=str(tiny_model), chunked_prefill_size=CHUNK)
    # long-a: two chunk steps, [0, 0.5 s] and [0.5 s, 1.0 s]; short comes early in the
    # second; long-b fills the rest of short's step and the next one
    start, sent, first_at, timings = _scenario(engine, tmp_path, [1000, 16, 1000], 0.62)
    ingress, queue = timings["ingress"], timings["queue"]
    prefill, emit = timings["prefill"], timings["emit"]
    print(  # the figures of the report (pytest -s)
        f"short: sent at {sent - start:.3f} s; ingress {ingress:.3f}, queue {queue:.3f}, "
        f"prefill {prefill:.3f}, emit {emit:.3f}, received {first_at - sent:.3f} s after "
        f"it was sent (its first token {first_at - sent - ingress - queue - prefill:.3f} s "
        "after its stamp)"
    )
    assert 0 < ingress < STEP_S + SLACK_S  # taken once the step in flight ended
    assert emit < 0.05  # sent as soon as its step was processed
    # everything is accounted for: the phases add up to what the frontend saw
    assert first_at - sent - (ingress + queue + prefill) < 0.05
    # the short prompt's step is shared with long-b (one chunk): behind the step in
    # flight when it came (and the one launched behind that, a decode step here) only
    assert first_at - sent < 2 * STEP_S + 2 * SLACK_S


def _short_outputs(pull: zmq.Socket) -> tuple[float, dict[str, float]]:
    """When the short request's first token reached the frontend, and its timings."""
    first_at = 0.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not pull.poll(1000):
            continue
        msg = decode_from_scheduler(pull.recv())
        if not isinstance(msg, OutputBatch):
            continue
        for out in msg.items:
            if out.rid != "short":
                continue
            if out.token_ids and not first_at:
                first_at = time.monotonic()
            if out.finished:
                return first_at, out.timings
    raise AssertionError("the short request did not finish")
