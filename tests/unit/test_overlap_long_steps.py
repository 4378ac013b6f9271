"""`overlap_max_step_tokens`: a step longer than that is processed before the next is
scheduled, so a request that comes while it runs joins the next step, not the one after."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("limit", [0, 32])
def test_a_request_that_comes_during_a_long_step_joins_the_next(
    tiny_model: Path, limit: int
) -> None:
    long_prompt, short_prompt = random_prompts([160, 8], vocab=2000, seed=3)
    with Engine(tiny_model, chunked_prefill_size=64, overlap_max_step_tokens=limit) as engine:
        sched = engine.scheduler
        processed: list[set[tuple[str, int]]] = []
        process = sched.outputs.process

        def spy(batch, step, result):  # type: ignore[no-untyped-def]
            processed.append({(it.req.rid, it.end) for it in batch.items})
            process(batch, step, result)

        sched.outputs.process = spy  # type: ignore[method-assign]
        sched.add_request("long", long_prompt, GREEDY)  # chunks of 64, 64 and 32 tokens
        # `short` comes while the loop waits for long's second chunk: taken after that
        while not any(("long", 128) in batch for batch in processed):
            sched.step()
        sched.add_request("short", short_prompt, GREEDY)
        sched.drain()
        [with_short] = [batch for batch in processed if ("short", 8) in batch]
        # overlapped, long's last chunk was launched before short came: short computes in
        # the step after it; past a long step, in the same one
        assert (("long", 160) in with_short) == (limit > 0)
        for rid, prompt in (("long", long_prompt), ("short", short_prompt)):
            assert engine._done[rid].output_ids == hf_greedy(tiny_model, prompt, 3)
        assert engine.all_pages_free()


class Device:
    """A GPU's stream, as the host sees it: the forward thread returns once a step's kernels
    are queued; the step ends `seconds` after the one before it ended (or after its launch,
    if the device was idle)."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def queue(self, seconds: float) -> DeviceEnd:
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return DeviceEnd(self.free_at)


class DeviceEnd:
    """A CUDA event's stand-in: `synchronize` returns when its step ended on the device."""

    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


def test_a_step_is_timed_to_its_end_on_the_device(tiny_model: Path) -> None:
    """On a GPU a prompt step was timed when its launch returned, and the decode step
    after it took its time (H200, session 32: mixed steps of 65 ms measured at
    ~35, the 8 ms decode steps after them at ~30): the decode step a decode worker plans
    with, the prompt line it sizes chunks by and the router's fits were all off."""
    prompts = random_prompts([40, 40, 40], vocab=2000, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    with Engine(tiny_model, chunked_prefill_size=64) as engine:
        sched = engine.scheduler
        execute, device = sched.runner.execute, Device()

        def slow_prompts(step):  # type: ignore[no-untyped-def]
            result = execute(step)
            prompt = len(step.columns.positions) > len(step.columns.req_slots)  # a chunk
            result.ready = device.queue(0.15 if prompt else 0.001)
            return result

        sched.runner.execute = slow_prompts  # type: ignore[method-assign]
        for i, prompt in enumerate(prompts):
            sched.add_request(f"r{i}", prompt, params)
            sched.step()
        sched.drain()
        t = sched.clock.times
        assert t.prefill_steps >= 3 and t.decode_steps >= 10
        assert t.prefill_seconds / t.prefill_steps >= 0.12  # each its own 150 ms
        assert t.decode_seconds / t.decode_steps < 0.03  # of 1 ms each: none took a prompt's
