"""Output under a JSON schema always parses and validates, whatever the seed (issue #42
item 3): xgrammar 0.2.8 writes a string with maxLength as a repetition of any character
but quote, backslash, CR and LF, so a raw control character such as \\x0b could land
inside it, which no JSON parser accepts, and every string may hold a UTF-16 surrogate as
bytes that are no UTF-8 (`common/layers/grammar.py`). The tiny model at temperature 1
samples such characters often, so many seeds find them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from baton.common.engine import Engine
from baton.common.layers.grammar import check, json_schema_ebnf
from baton.common.sampling import GrammarSpec, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.timeout(600)

SEEDS = range(64)
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "minLength": 2, "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "code", "tags"],
    "additionalProperties": False,
}
UNBOUNDED = {
    "type": "object",
    "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["note", "n"],
    "additionalProperties": False,
}


def valid_bounded(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "code", "tags"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and isinstance(value["code"], str)
        and 2 <= len(value["code"]) <= 6
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 4 for t in value["tags"])
    )


def valid_unbounded(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"note", "n"}
        and isinstance(value["note"], str)
        and isinstance(value["n"], int)
    )


def sample(tiny_model, schema: dict[str, Any], max_tokens: int) -> list[tuple[int, str, str]]:
    """(seed, text, finish reason) of one answer per seed at temperature 1."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    prompts = random_prompts([7] * len(SEEDS), vocab=2000, seed=5)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=max_tokens, seed=s, grammar=grammar)
        for s in SEEDS
    ]
    with Engine(tiny_model, page_size=4) as engine:
        outs = engine.generate(prompts, params)
    return [
        (seed, tokenizer.decode(out.output_ids, skip_special_tokens=True), out.finish_reason)
        for seed, out in zip(SEEDS, outs, strict=True)
    ]


def parsed(seed: int, text: str) -> Any:
    try:
        return json.loads(text)  # strict: a raw control character inside is an error
    except ValueError as e:
        raise AssertionError(f"seed {seed}: {text!r} is not JSON: {e}") from None


def test_bounded_strings_parse_and_validate_for_every_seed(tiny_model) -> None:
    # before the fix, 9 of these 64 answers held a raw control character, and one a
    # surrogate as three bytes, which decode to three U+FFFD (too long for its maxLength)
    for seed, text, finish in sample(tiny_model, BOUNDED, max_tokens=96):
        assert finish == "stop", (seed, text)
        assert valid_bounded(parsed(seed, text)), (seed, text)


def test_unbounded_strings_hold_no_raw_control_character_for_any_seed(tiny_model) -> None:
    # A string without a bound runs for hundreds of tokens at temperature 1 on the tiny
    # model: every answer, cut or not, is checked for raw control characters (compact JSON
    # has none anywhere), and those that finished must parse and validate.
    answers = sample(tiny_model, UNBOUNDED, max_tokens=128)
    for seed, text, finish in answers:
        # a cut answer may end inside a character's bytes
        whole = text if finish == "stop" else text.rstrip("\ufffd")
        assert not any(ord(c) < 0x20 or c == "\ufffd" for c in whole), (seed, text)
        if finish == "stop":
            assert valid_unbounded(parsed(seed, text)), (seed, text)
    assert any(finish == "stop" for *_, finish in answers)


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 5}, {"type": "string"}])
def test_strings_refuse_raw_control_characters_and_surrogates(schema: dict[str, Any]) -> None:
    from xgrammar import Grammar
    from xgrammar.testing import _get_matcher_from_grammar

    grammar = Grammar.from_ebnf(json_schema_ebnf(json.dumps(schema)))

    def accepts(text: bytes) -> bool:
        matcher = _get_matcher_from_grammar(grammar)
        return bool(matcher.accept_string(text) and matcher.is_terminated())

    assert accepts(b'"abc"') and accepts('"é\x7f😀"'.encode())
    for control in ("\x00", "\x0b", "\t", "\x1f", "\n"):
        assert not accepts(f'"a{control}b"'.encode()), repr(control)
    assert not accepts(b'"a\xed\xb9\x9db"')  # U+DE5D as three bytes: no UTF-8
    check(GrammarSpec("json_schema", json.dumps(BOUNDED)))  # the router accepts it
