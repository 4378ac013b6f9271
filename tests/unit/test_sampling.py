from __future__ import annotations

import pytest

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("max_new_tokens", -1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("presence_penalty", -2.5),
        ("top_logprobs", 99),
        ("seed", -1),
        ("temperature", float("nan")),
    ],
)
def test_bad_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_seed_gives_same_tokens_alone_and_in_a_batch(tiny_model) -> None:
    prompts = random_prompts([10, 30, 4, 17], vocab=2000, seed=5)
    seeded = SamplingParams(
        temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_new_tokens=16, ignore_eos=True
    )
    other = SamplingParams(temperature=0.8, max_new_tokens=20, ignore_eos=True)
    with Engine(tiny_model, page_size=4) as engine:
        alone = engine.generate([prompts[0]], seeded)[0].output_ids
        batch = engine.generate(prompts, [seeded, other, other, other])
        assert batch[0].output_ids == alone
        again = engine.generate([prompts[2], prompts[0]], [other, seeded])
        assert again[1].output_ids == alone
        unseeded = engine.generate(
            [prompts[0]] * 2, SamplingParams(max_new_tokens=16, ignore_eos=True)
        )
        assert unseeded[0].output_ids != unseeded[1].output_ids


def test_penalties_and_filters_change_sampling(tiny_model) -> None:
    prompt = random_prompts([20], vocab=2000, seed=2)
    with Engine(tiny_model) as engine:
        greedy = engine.generate(
            prompt, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
        )[0].output_ids
        penalized = engine.generate(
            prompt,
            SamplingParams(
                temperature=0,
                max_new_tokens=32,
                ignore_eos=True,
                repetition_penalty=1.8,
                frequency_penalty=1.5,
                presence_penalty=1.0,
            ),
        )[0].output_ids
        assert len(set(penalized)) >= len(set(greedy))
        assert penalized != greedy
        # top_k=1 sampling is greedy whatever the temperature
        topk1 = engine.generate(
            prompt,
            SamplingParams(temperature=1.5, top_k=1, seed=9, max_new_tokens=32, ignore_eos=True),
        )
        assert topk1[0].output_ids == greedy
        # min_p=1 keeps only the most likely token
        minp = engine.generate(
            prompt,
            SamplingParams(temperature=1.0, min_p=1.0, seed=9, max_new_tokens=32, ignore_eos=True),
        )
        assert minp[0].output_ids == greedy


def test_logprobs_of_each_output_token(tiny_model) -> None:
    prompt = random_prompts([9], vocab=2000, seed=4)
    with Engine(tiny_model) as engine:
        out = engine.generate(
            prompt,
            SamplingParams(
                temperature=0, max_new_tokens=5, logprobs=True, top_logprobs=3, ignore_eos=True
            ),
        )[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, lp in zip(out.output_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy = most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_logit_bias_forces_and_bans_tokens(tiny_model) -> None:
    prompt = random_prompts([12], vocab=2000, seed=3)
    with Engine(tiny_model) as engine:
        greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        plain = engine.generate(prompt, greedy)[0].output_ids
        forced = engine.generate(prompt, greedy.replace(logit_bias={777: 100.0}))[0]
        assert forced.output_ids == [777] * 8
        banned = engine.generate(prompt, greedy.replace(logit_bias={plain[0]: -100.0}))[0]
        assert banned.output_ids[0] != plain[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**31), ("top_k", -2), ("max_new_tokens", 2**31), ("stop_token_ids", [2**31])],
)
def test_integers_stay_within_the_wire_format(field: str, value: object) -> None:
    # Every integer travels as protobuf int32: a larger one must be a clear ValueError here,
    # not an encoding error (a 500) on the way to a worker.
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=40, seed=77, max_new_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.9, seed=5, frequency_penalty=1.5, max_new_tokens=12, ignore_eos=True
        ),
    ],
    ids=["greedy", "sampled", "penalized"],
)
def test_a_resumed_request_continues_the_same_output(tiny_model, sampling) -> None:
    # What the router sends when it migrates a stream after 5 tokens: the prompt plus those
    # tokens, output_offset 5, the rest of the budget. The continuation must be the one an
    # uninterrupted run produced: same seed positions, same penalty counts.
    prompt = random_prompts([9], vocab=2000, seed=3)[0]
    with Engine(tiny_model, page_size=4) as engine:
        whole = engine.generate([prompt], sampling)[0].output_ids
        resumed = sampling.replace(max_new_tokens=7, output_offset=5)
        rest = engine.generate([prompt + whole[:5]], resumed)[0].output_ids
    assert rest == whole[5:]
