"""Logprobs, top logprobs and prompt logprobs on CUDA, where a step's values reach the host
through pinned copies behind an event (`SampleResult.to_host`), equal the CPU engine's on
the same weights."""

from __future__ import annotations

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import hf_prompt_logprobs, random_prompts

PARAMS = SamplingParams(
    temperature=0,
    max_new_tokens=12,
    logprobs=True,
    top_logprobs=3,
    prompt_logprobs=2,
    ignore_eos=True,
)


def test_cuda_logprobs_equal_the_cpu_engine(tiny_model) -> None:
    prompts = random_prompts([5, 23, 64], vocab=2000, seed=11)
    with Engine(tiny_model) as cpu:
        want = cpu.generate(prompts, PARAMS)
    opts = {"device": "cuda", "dtype": "float32", "attention_backend": "torch"}
    with Engine(tiny_model, **opts) as gpu:
        got = gpu.generate(prompts, PARAMS)
    for prompt, g, w in zip(prompts, got, want, strict=True):
        assert g.output_ids == w.output_ids
        assert g.logprobs is not None and w.logprobs is not None
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
            assert a.top[0][0] == b.top[0][0]  # rank by rank: near-ties may swap ids
            assert all(abs(x[1] - y[1]) < 1e-3 for x, y in zip(a.top, b.top, strict=True))
        assert g.prompt_logprobs is not None
        assert [lp.token_id for lp in g.prompt_logprobs] == prompt[1:]
        hf = hf_prompt_logprobs(tiny_model, prompt)
        assert max(abs(a.logprob - b) for a, b in zip(g.prompt_logprobs, hf, strict=True)) < 1e-3
