"""Structured output at the edge: every public spelling of a constraint, checked and turned
into one `GrammarSpec` for the workers.

    response_format {json_object | json_schema}     OpenAI
    regex, ebnf                                     SGLang
    structured_outputs {json|regex|choice|grammar}  vLLM (and its older guided_* fields)

At most one constraint per request. A schema, regex or grammar that xgrammar cannot
build is a 400 naming the field that carried it.
"""

from __future__ import annotations

import json
from typing import Any

from baton.common.layers.grammar import check, choice_ebnf
from baton.common.sampling import GrammarSpec
from baton.services.router.errors import bad_request
from baton.services.router.schemas import StructuredFields

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def json_schema_spec(schema: dict[str, Any] | bool | str, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{param}: not valid JSON: {e}", param) from e
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return checked(GrammarSpec("json_schema", json.dumps(schema)), param)


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    try:
        check(spec)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from e
    return spec


def _choice(choices: list[str], param: str) -> GrammarSpec:
    if not choices or any(not c for c in choices):
        raise bad_request(f"{param}: needs at least one non-empty choice", param)
    return checked(GrammarSpec("ebnf", choice_ebnf(choices)), param)


def grammar_from_fields(body: StructuredFields) -> GrammarSpec | None:
    """The request's constraint, or None. Raises APIError (400) for a bad one or several."""
    found: list[tuple[str, GrammarSpec]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", json_schema_spec(ANY_JSON_OBJECT, "response_format")))
    elif fmt is not None and fmt.type == "json_schema":
        param = "response_format.json_schema"
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request(f"{param}.schema is required for type json_schema", param)
        found.append(("response_format", json_schema_spec(fmt.json_schema.json_schema, param)))
    if body.regex is not None:
        found.append(("regex", checked(GrammarSpec("regex", body.regex), "regex")))
    if body.ebnf is not None:
        found.append(("ebnf", checked(GrammarSpec("ebnf", body.ebnf), "ebnf")))
    if body.structured_outputs is not None:
        found.append(_structured_outputs(body))
    for name, value in (
        ("guided_json", body.guided_json),
        ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice),
        ("guided_grammar", body.guided_grammar),
    ):
        if value is not None:
            found.append((name, _guided(name, value)))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise bad_request(
            f"at most one structured-output constraint per request; got {', '.join(names)}",
            names[1],
        )
    return found[0][1] if found else None


def _structured_outputs(body: StructuredFields) -> tuple[str, GrammarSpec]:
    so = body.structured_outputs
    assert so is not None
    param = "structured_outputs"
    given = [
        name
        for name, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise bad_request(
            f"{param}: set exactly one of json, regex, choice, grammar, json_object "
            f"(got {sorted(given) or 'none'})",
            param,
        )
    where = f"{param}.{given[0]}"
    if so.json_ is not None:
        return param, json_schema_spec(so.json_, where)
    if so.json_object:
        return param, json_schema_spec(ANY_JSON_OBJECT, where)
    if so.choice is not None:
        return param, _choice(so.choice, where)
    if so.regex is not None:
        return param, checked(GrammarSpec("regex", so.regex), where)
    assert so.grammar is not None
    return param, checked(GrammarSpec("ebnf", so.grammar), where)


def _guided(name: str, value: Any) -> GrammarSpec:
    if name == "guided_json":
        return json_schema_spec(value, name)
    if name == "guided_choice":
        return _choice(value, name)
    kind = "regex" if name == "guided_regex" else "ebnf"
    return checked(GrammarSpec(kind, value), name)
