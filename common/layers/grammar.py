"""Structured output with xgrammar: grammars checked, compiled, and matched token by token.

    GrammarSpec (router: checked with `check`)
        → worker: `GrammarBackend.matcher(spec)` compiles it against the vocabulary (cached)
        → per request `Matcher`: `fill(bitmask, row)` before sampling, `accept(token)` after

The router and the worker build grammars with the same options (compact JSON: no free
whitespace, which a weak model would otherwise fill forever), so a spec the router
accepts compiles on the worker. xgrammar is imported on first use: a server that never
sees a constrained request never loads it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.common.sampling import GrammarSpec

_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
ANY_WHITESPACE = False
# xgrammar (0.2.8, the newest) writes a JSON string's characters with two classes, both
# too wide. A string with minLength/maxLength repeats "any character but quote, backslash,
# CR and LF", so a raw control character (\x0b, a tab) could land inside it and no JSON
# parser would read the answer. Both classes also admit UTF-16 surrogates, which a
# byte-level tokenizer writes as three bytes that are no UTF-8: each decodes to U+FFFD, so
# a string that fit its maxLength by code points no longer does. Baton's class excludes
# both; escapes stay out of bounded strings, as xgrammar has them.
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"
_WIDE_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")  # bounded, unbounded


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _message(e: Exception) -> str:
    """xgrammar's error text without its log prefix (time, C++ source line)."""
    return _LOG_PREFIX.sub("", str(e)).strip() or type(e).__name__


@functools.lru_cache(maxsize=256)
def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar of a JSON schema (text), as xgrammar converts it with baton's
    options, with its strings kept to JSON's characters in UTF-8. Raises RuntimeError (a
    schema xgrammar cannot convert)."""
    grammar = _xgr().Grammar.from_json_schema(schema, any_whitespace=ANY_WHITESPACE)
    ebnf = str(grammar)
    for wide in _WIDE_STRING_CHARS:
        ebnf = ebnf.replace(wide, _JSON_STRING_CHAR)
    return ebnf


def check(spec: GrammarSpec) -> None:
    """Raise ValueError (with xgrammar's reason) unless `spec` is a valid grammar."""
    xgr = _xgr()
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_ebnf(json_schema_ebnf(spec.value))
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.value)
        else:
            raise ValueError(f"unknown grammar kind {spec.kind!r}")
    except RuntimeError as e:
        raise ValueError(_message(e)) from e


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar that matches exactly one of `choices`."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (state unchanged)."""
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._m.is_terminated())


class GrammarBackend:
    """A worker's grammar compiler: the tokenizer's vocabulary as xgrammar sees it (made
    on the first constrained request) and a cache of compiled grammars."""

    def __init__(self, model_path: str | Path, vocab_size: int, stop_token_ids: Sequence[int]):
        self._model_path = str(model_path)
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_token_ids)
        self._compiler: Any = None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            from transformers import AutoTokenizer

            xgr = _xgr()
            tokenizer = AutoTokenizer.from_pretrained(self._model_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher at the start of `spec`. Raises ValueError for a bad grammar."""
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_schema":
                compiled = compiler.compile_grammar(json_schema_ebnf(spec.value))
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "ebnf":
                compiled = compiler.compile_grammar(spec.value)
            else:
                raise ValueError(f"unknown grammar kind {spec.kind!r}")
        except RuntimeError as e:
            raise ValueError(f"grammar: {_message(e)}") from e
        return Matcher(_xgr().GrammarMatcher(compiled))


def grammar_bitmask(rows: int, vocab_size: int, matchers: list[tuple[int, Matcher]]) -> Any:
    """[rows, ceil(vocab_size / 32)] int32 on the host: the tokens each (row, matcher)'s
    grammar allows, every token in the other rows."""
    mask = _xgr().allocate_token_bitmask(rows, vocab_size)
    for row, matcher in matchers:
        matcher.fill(mask, row)
    return mask


def apply_bitmask(logits: Any, bitmask: Any) -> None:
    """Set to -inf, in place, the logits their bitmask rows forbid ([B, V] and [B, V/32])."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
