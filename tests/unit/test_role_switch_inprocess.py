"""A scheduler's role swapped in place (issue 41 item 2), in one process with the real KV
transfer layer: a decode worker becomes a prefill worker and the prefill worker a decode
worker; requests through the swapped pair keep transformers' greedy tokens, the old
managers are shut down, and no page is left held."""

from __future__ import annotations

import pytest

from baton.common.config import ModelConfig, TransferConfig
from baton.common.disagg.decode_role import DecodeRole
from baton.common.disagg.prefill_role import PrefillRole
from baton.common.disagg.start import switch_role
from baton.common.protocol import GenerateReq, PeerInfo
from baton.common.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.unit.test_disagg_inprocess import assert_drained, make_side, run_pd, shutdown

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def swap(side, old_name: str, role: str, model):  # type: ignore[no-untyped-def]
    sched, handler, sink = side
    transfer = TransferConfig(backend="tcp", room_timeout=5.0, verify_checksum=True)
    new, error = switch_role(
        sched, handler, old_name, role, ModelConfig.from_pretrained(model), transfer
    )
    assert error == ""
    return sched, new, sink


def test_swapped_roles_keep_greedy_tokens_and_leak_nothing(tiny_model) -> None:  # type: ignore[no-untyped-def]
    p = make_side(tiny_model, "prefill", "tcp")
    d1 = make_side(tiny_model, "decode", "tcp")
    d2 = make_side(tiny_model, "decode", "tcp")
    sides = [p, d1, d2]
    try:
        prompts = random_prompts([3, 40, 90], vocab=2000, seed=5)
        expected = [hf_greedy(tiny_model, pr, 8) for pr in prompts]
        assert run_pd(p, d1, prompts, PARAMS)[0] == expected
        old_manager = d2[1].manager
        d2 = sides[2] = swap(d2, "decode", "prefill", tiny_model)
        assert isinstance(d2[1], PrefillRole) and d2[0].hooks is d2[1]
        assert d2[0].outputs.hooks is d2[1] and not d2[0].hooks.decodes_locally
        assert old_manager.role == "decode" and d2[1].manager is not old_manager
        assert run_pd(d2, d1, prompts, PARAMS)[0] == expected  # the new P
        p = sides[0] = swap(p, "prefill", "decode", tiny_model)
        assert isinstance(p[1], DecodeRole)
        assert run_pd(d2, p, prompts, PARAMS)[0] == expected  # the new P into the new D
        assert_drained(*sides)
    finally:
        shutdown(*sides)


def test_no_swap_while_the_role_holds_a_request(tiny_model) -> None:  # type: ignore[no-untyped-def]
    d = make_side(tiny_model, "decode", "tcp")
    try:
        sched, handler, _ = d
        peer = PeerInfo("p", "tcp://127.0.0.1:1")  # never answers: the room waits
        handler.on_generate(GenerateReq("r1", [1, 2, 3], PARAMS, 7, peer))
        model_cfg = ModelConfig.from_pretrained(tiny_model)
        with pytest.raises(ValueError, match="still on this worker"):
            switch_role(sched, handler, "decode", "prefill", model_cfg)
        assert sched.hooks is handler  # nothing changed
        with pytest.raises(ValueError, match="unknown role"):
            switch_role(sched, handler, "decode", "sideways", model_cfg)
        handler.on_abort("r1")
        handler.poll()
    finally:
        shutdown(d)
