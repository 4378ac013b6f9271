"""The router's `baton_timings`: the phases up to the first token add up to its TTFT."""

from __future__ import annotations

import time

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.attempt import Timings

WORKER = {"ingress": 0.25, "queue": 0.5, "prefill": 1.0, "emit": 0.0, "kv_transfer": 0.0}


def test_phases_add_up_to_the_first_token() -> None:
    t = Timings(router_queue=0.125, began=100.0)
    t.first_token_at = 102.0  # as token_arrived stamps it
    t.note(pb.BOTH, WORKER)
    phases = t.router_queue + t.ingress + t.prefill_queue + t.prefill_compute
    assert t.first_token_delivery == 0.25
    assert phases + t.first_token_delivery == t.router_queue + (t.first_token_at - t.began)
    assert set(t.as_dict()) >= {"ingress", "first_token_delivery", "first_text_wait"}
    assert not {"began", "first_token_at", "first_text_at"} & set(t.as_dict())


def test_the_worker_that_computed_the_prompt_counts() -> None:
    pd = Timings()
    pd.note(pb.PREFILL, WORKER)
    pd.note(pb.DECODE, {"ingress": 3.0, "queue": 0.0, "prefill": 0.0, "decode_admission": 0.5})
    assert (pd.ingress, pd.prefill_compute, pd.decode_admission) == (0.25, 1.0, 0.5)
    local = Timings()  # a D placed "local" computes the prompt itself
    local.note(pb.DECODE, WORKER)
    assert (local.ingress, local.prefill_queue, local.prefill_compute) == (0.25, 0.5, 1.0)


def test_first_token_and_first_text_are_stamped_once() -> None:
    t = Timings()
    t.text_sent()  # no token yet: nothing to measure from
    assert t.first_text_at == 0.0
    t.token_arrived()
    first = t.first_token_at
    time.sleep(0.01)
    t.token_arrived()
    t.text_sent()
    t.text_sent()
    assert t.first_token_at == first and t.first_text_wait >= 0.01
    assert t.first_text_wait == t.first_text_at - first
