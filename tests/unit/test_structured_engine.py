"""The engine under constraints: grammars shape sampled text, prompt logprobs match HF."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from baton.common.engine import Engine
from baton.common.sampling import GrammarSpec, SamplingParams
from tests.conftest import hf_prompt_logprobs, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_at_temperature_one(tiny_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompts = random_prompts([9, 30], vocab=2000, seed=4)
    with Engine(tiny_model, page_size=4) as engine:
        for seed in range(4):
            params = SamplingParams(temperature=1.0, max_new_tokens=96, seed=seed, grammar=grammar)
            for out in engine.generate(prompts, params):
                assert out.finish_reason == "stop", out
                value = json.loads(tokenizer.decode(out.output_ids, skip_special_tokens=True))
                assert set(value) == set(SCHEMA["properties"])  # type: ignore[arg-type]
                assert 0 <= value["age"] <= 120 and len(value["name"]) <= 8
                assert value["tag"] in ("red", "green", "blue")
        engine.check_integrity()


@pytest.mark.parametrize("overlap", [True, False])
def test_regex_full_match_same_with_and_without_overlap(tiny_model, overlap: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    pattern = r"(cat|dog)-[0-9]{2,4}!"
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=32,
        seed=11,
        grammar=GrammarSpec("regex", pattern),
        ignore_eos=True,  # the grammar ends it
    )
    free = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    prompts = random_prompts([5, 17, 40], vocab=2000, seed=8)
    with Engine(tiny_model, disable_overlap=not overlap, chunked_prefill_size=16) as engine:
        outs = engine.generate(prompts, [params, free, params])
    texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    assert re.fullmatch(pattern, texts[0]) and re.fullmatch(pattern, texts[2]), texts
    assert outs[0].finish_reason == "stop" and len(outs[1].output_ids) == 12
    with Engine(tiny_model, disable_overlap=overlap, chunked_prefill_size=16) as engine:
        again = engine.generate(prompts, [params, free, params])
    assert [o.output_ids for o in again] == [o.output_ids for o in outs]


def test_bad_grammar_fails_only_its_request(tiny_model) -> None:
    with Engine(tiny_model) as engine:
        bad = SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", "a("))
        with pytest.raises(ValueError, match="grammar"):
            engine.generate([[5, 6, 7]], bad)
        assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))[0].output_ids)


def word_prompts(tiny_model, count: int) -> list[list[int]]:
    """Short texts over a 16-word vocabulary (an lm-eval style batch): many share prefixes."""
    import random

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "while",
        "dogs",
        "ran",
        "across",
        "fields",
        "of",
        "green",
        "grass",
        "near",
        "old",
    ]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 16))) for _ in range(count)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_prompt_logprobs_of_a_batch_sharing_prefixes(tiny_model) -> None:
    """Requests that read no cache must not swap pages with it while their prompt is being
    computed (a bug that corrupted a co-batched prompt's KV)."""
    prompts = word_prompts(tiny_model, 28)
    params = SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    with Engine(tiny_model) as engine:
        for batch in (prompts[:16], prompts[16:]):
            for prompt, out in zip(batch, engine.generate(batch, params), strict=True):
                want = hf_prompt_logprobs(tiny_model, prompt)
                got = [lp.logprob for lp in out.prompt_logprobs or []]
                assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
        engine.check_integrity()


@pytest.mark.parametrize(("page_size", "chunk"), [(1, None), (4, 8)])
def test_prompt_logprobs_equal_transformers(tiny_model, page_size: int, chunk: int | None) -> None:
    # prompts sharing a prefix in one batch, then others: each computes its own prefix (it
    # reads no cache) and must not hand pages it is writing to the prompts after it
    prompts = random_prompts([3, 9, 30], vocab=2000, seed=9, prefix=[11, 12, 13, 14, 15, 16])
    prompts += random_prompts([2, 21, 45], vocab=2000, seed=page_size)
    params = SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=2)
    with Engine(tiny_model, page_size=page_size, chunked_prefill_size=chunk) as engine:
        engine.generate(prompts, SamplingParams(max_new_tokens=1))  # fill the prefix cache
        outs = engine.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            got = out.prompt_logprobs
            assert got is not None and [lp.token_id for lp in got] == prompt[1:]
            want = hf_prompt_logprobs(tiny_model, prompt)
            assert max(abs(a.logprob - b) for a, b in zip(got, want, strict=True)) < 1e-3
            assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in got)
        engine.check_integrity()


def test_prompt_logprobs_beside_prompts_that_sample_one_row(tiny_model) -> None:
    """The model's last layer computes only the rows whose logits a step needs: every row
    of a prompt asking for its logprobs, the last row of the others in the same step."""
    from tests.conftest import hf_greedy

    prompts = random_prompts([25, 40, 31], vocab=2000, seed=21)
    wants = SamplingParams(temperature=0, max_new_tokens=4, prompt_logprobs=1)
    plain = SamplingParams(temperature=0, max_new_tokens=4)
    with Engine(tiny_model, page_size=4) as engine:
        outs = engine.generate(prompts, [plain, wants, plain])
        engine.check_integrity()
    got = outs[1].prompt_logprobs
    assert got is not None and [lp.token_id for lp in got] == prompts[1][1:]
    want = hf_prompt_logprobs(tiny_model, prompts[1])
    assert max(abs(a.logprob - b) for a, b in zip(got, want, strict=True)) < 1e-3
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(tiny_model, prompt, 4)


def test_structured_output_and_prompt_logprobs_same_in_1p1d(tiny_model) -> None:
    """P samples the first token under the grammar and computes the prompt logprobs; D
    rebuilds the grammar and continues it: tokens equal the aggregated engine's."""
    from tests.unit.test_disagg_inprocess import assert_drained, make_side, run_pd, shutdown

    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompts = random_prompts([6, 33], vocab=2000, seed=12)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=96, seed=s, grammar=grammar) for s in (1, 2)
    ]
    with Engine(tiny_model, page_size=4) as engine:
        want = [o.output_ids for o in engine.generate(prompts, params)]
    p = make_side(tiny_model, "prefill", "tcp", page_size=4, chunked_prefill_size=16)
    d = make_side(tiny_model, "decode", "tcp", page_size=4)
    try:
        for param, prompt, expected in zip(params, prompts, want, strict=True):
            outs, _ = run_pd(p, d, [prompt], param)
            assert outs == [expected]
        logprobs = SamplingParams(temperature=0, max_new_tokens=3, prompt_logprobs=0)
        run_pd(p, d, [prompts[1]], logprobs)
        (first,) = [r for r in p[2].done.values() if r.sampling.prompt_logprobs is not None]
        want_lp = hf_prompt_logprobs(tiny_model, prompts[1])
        assert [lp.token_id for lp in first.prompt_logprobs] == prompts[1][1:]
        errors = [abs(a.logprob - b) for a, b in zip(first.prompt_logprobs, want_lp, strict=True)]
        assert max(errors) < 1e-3
        assert_drained(p, d)
    finally:
        shutdown(p, d)


def test_a_resumed_request_continues_in_its_grammar(tiny_model) -> None:
    # The router migrated this request after 6 tokens: it resumes with those tokens at the
    # end of its prompt (output_offset 6). Its grammar continues after them, not from its
    # start, and the output is the one the uninterrupted run produced.
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = random_prompts([9], vocab=2000, seed=4)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=96, seed=2, grammar=grammar)
    with Engine(tiny_model, page_size=4) as engine:
        whole = engine.generate([prompt], params)[0]
        resumed = params.replace(max_new_tokens=90, output_offset=6)
        rest = engine.generate([prompt + whole.output_ids[:6]], resumed)[0]
        bad = params.replace(output_offset=3)  # three random prompt tokens: not in the grammar
        with pytest.raises(ValueError, match="does not match the grammar"):
            engine.generate([prompt], bad)
        engine.check_integrity()
    assert rest.output_ids == whole.output_ids[6:]
    assert rest.finish_reason == whole.finish_reason == "stop"
