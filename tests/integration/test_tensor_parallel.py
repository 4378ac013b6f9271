"""Tensor parallelism over gloo on the CPU: TP=2 gives TP=1's greedy tokens."""

from __future__ import annotations

import pytest

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_matches_tp1_and_transformers(model_factory, arch: str) -> None:
    model = model_factory(arch)
    prompts = random_prompts([1, 13, 77, 150], vocab=2000, seed=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    with Engine(model, tp_size=2, page_size=4, chunked_prefill_size=32) as engine:
        outs = engine.generate(prompts, params)
        engine.check_integrity()
        # seeded sampling too: rank 0 samples from the gathered logits
        seeded = engine.generate(
            prompts[:2], SamplingParams(temperature=0.8, seed=5, max_new_tokens=8, ignore_eos=True)
        )
    assert [o.output_ids for o in outs] == [hf_greedy(model, p, 16) for p in prompts]
    with Engine(model, page_size=4) as single:
        ref = single.generate(
            prompts[:2], SamplingParams(temperature=0.8, seed=5, max_new_tokens=8, ignore_eos=True)
        )
    assert [o.output_ids for o in seeded] == [o.output_ids for o in ref]


@pytest.mark.parametrize(
    "tp_args", [["--prefill-tp", "2"], ["--decode-tp", "2"]], ids=["P-tp2-D-tp1", "P-tp1-D-tp2"]
)
def test_heterogeneous_tp_pd_matches_aggregated(tmp_path, tp_args: list[str]) -> None:  # type: ignore[no-untyped-def]
    """P and D at different TP sizes: KV heads are gathered on P's rank 0 and scattered
    from D's rank 0, so the wire always carries full-head pages."""
    from baton.common.models.tiny import default_model_path
    from tests.integration.cluster import cluster

    model = default_model_path()
    prompts = random_prompts([5, 40, 90], vocab=2000, seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    with Engine(model) as engine:
        expected = [o.output_ids for o in engine.generate(prompts, params)]
    with cluster(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "32",
        *tp_args,
    ) as c:
        for prompt, want in zip(prompts, expected, strict=True):
            status, body = c.post(
                "/generate",
                {
                    "input_ids": prompt,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
                },
            )
            assert status == 200, body
            assert body["output_ids"] == want
        c.wait_idle()
