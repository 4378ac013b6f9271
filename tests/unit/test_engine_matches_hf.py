"""The correctness oracle: baton's greedy tokens equal transformers' generate()."""

from __future__ import annotations

import pytest

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import FAMILIES, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_equals_transformers(model_factory, arch: str, page_size: int) -> None:
    model = model_factory(arch)
    prompts = random_prompts([1, 5, 37, 300], vocab=2000, seed=page_size)
    with Engine(model, page_size=page_size, max_total_tokens=4096) as engine:
        outs = engine.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.output_ids == hf_greedy(model, prompt, 24), f"prompt of {len(prompt)}"
            assert out.finish_reason == "length"
        engine.check_integrity()
        assert engine.all_pages_free()


def test_long_generation_64_tokens(tiny_model) -> None:
    prompts = random_prompts([3, 120], vocab=2000, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    with Engine(tiny_model, page_size=4, max_total_tokens=2048) as engine:
        outs = engine.generate(prompts, params)
        assert [o.output_ids for o in outs] == [hf_greedy(tiny_model, p, 64) for p in prompts]
        engine.check_integrity()
        assert engine.all_pages_free()


def test_outputs_are_not_degenerate(tiny_model) -> None:
    """The tiny model must produce varied tokens, or equality tests would prove little."""
    prompts = random_prompts([8, 16, 32], vocab=2000, seed=3)
    with Engine(tiny_model) as engine:
        outs = engine.generate(prompts, GREEDY)
    assert len({t for o in outs for t in o.output_ids}) >= 10
    assert len({tuple(o.output_ids) for o in outs}) == 3


def test_eos_stops_generation(tiny_model) -> None:
    with Engine(tiny_model) as engine:
        eos = engine.model_config.eos_token_ids[0]
        prompt = random_prompts([12], vocab=2000, seed=1)[0]
        first = engine.generate([prompt], GREEDY)[0].output_ids
        # make the third greedy token a stop token: generation ends there, reason "stop"
        params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[first[2]])
        out = engine.generate([prompt], params)[0]
        assert out.output_ids == first[: first.index(first[2]) + 1]
        assert out.finish_reason == "stop"
        # min_new_tokens masks stop tokens until reached
        params = SamplingParams(
            temperature=0.0, max_new_tokens=10, min_new_tokens=10, stop_token_ids=[first[0], eos]
        )
        out = engine.generate([prompt], params)[0]
        assert len(out.output_ids) == 10 and first[0] not in out.output_ids[:1]
