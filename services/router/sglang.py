"""SGLang's native `POST /generate`: the request it takes and the answer it gives.

    {"text": "..." | ["...", ...] | "input_ids": [...] | [[...], ...],
     "sampling_params": {...}, "stream": bool, "return_logprob": bool,
     "top_logprobs_num": k, "logprob_start_len": n, "return_text_in_logprobs": bool,
     "rid": "..." | ["...", ...]}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", ...},
        "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
        "output_token_logprobs", "output_top_logprobs", "input_token_logprobs", ...}}

A list of texts (or of token-id lists) is a batch, answered by a list (SGLang frontend's
`select` scores its choices this way). Streamed, every event carries one item's text and
output ids so far (SGLang's cumulative stream; a batch's events name their `index`).
`sampling_params` takes SGLang's names; one this server does not know is a 400 naming it.
SGLang's meanings, kept here:

- `max_new_tokens: 0` computes (and caches) the prompt and returns no token: its prompt
  logprobs, if asked. The workers compute one token, which the answer leaves out.
- `logprob_start_len` (with `return_logprob`): input logprobs from that prompt position
  on; -1 (the default): none; past the prompt's end: a 400 (SGLang refuses it too).
- A logprob is a `[logprob, token id, text]` triple; the text only with
  `return_text_in_logprobs` (each token decoded alone), else null.
- `skip_special_tokens: false` keeps special tokens in the text (the stop token that ends
  the generation excepted, as SGLang trims it). `spaces_between_special_tokens` changes
  only a slow (Python) tokenizer's decode; the router decodes with the model's fast
  tokenizer, as SGLang's server does, so either value gives the same text as SGLang's.
- `stop_regex` is not supported: null only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from baton.common.sampling import GrammarSpec, SamplingParams
from baton.common.state import TokenLogprob
from baton.common.tokenizer import Tokenizer
from baton.services.router.errors import APIError, bad_request
from baton.services.router.formats import ResponseFormat
from baton.services.router.params import (
    MAX_CHOICES,
    ChoiceSpec,
    PreparedRequest,
    RequestPreparer,
)
from baton.services.router.schemas import MAX_STOP_STRINGS, GenerateRequest
from baton.services.router.streams import Delta
from baton.services.router.structured import checked, json_schema_spec

# SGLang's sampling_params that map onto the engine's fields of the same name
_SAME_NAME = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop_token_ids",
    "ignore_eos",
)
_TYPES: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,),
    "min_new_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "stop": (str, list),
    "json_schema": (str, dict),
    "regex": (str,),
    "ebnf": (str,),
    "logit_bias": (dict,),
    "sampling_seed": (int,),
    "n": (int,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "stop_regex": (str, list),
}
_ITEM_TYPES: dict[str, tuple[type, ...]] = {
    "stop_token_ids": (int,),
    "stop": (str,),
    "stop_regex": (str,),
}


@dataclass(frozen=True)
class GenerateShape:
    """What the answer holds beyond the generation itself, as the request asked."""

    batch: bool  # the prompts came as a list: so does the answer
    item_ids: list[str] | None  # `rid`, one per prompt, if given
    prefill_only: bool  # max_new_tokens 0: no token in the answer
    logprobs: bool  # return_logprob
    logprob_start_len: int  # -1: no input logprobs
    text_in_logprobs: bool


def prepare_generate(
    preparer: RequestPreparer, body: GenerateRequest
) -> tuple[PreparedRequest, GenerateShape]:
    params = body.sampling_params
    _check_types(params)
    if params.get("n") not in (None, 1):
        raise bad_request("sampling_params.n: only 1 is supported", "sampling_params.n")
    if params.get("stop_regex") not in (None, [], ""):
        raise bad_request(
            "sampling_params.stop_regex is not supported (use stop strings)",
            "sampling_params.stop_regex",
        )
    prompts, batch = _prompts(preparer, body)
    item_ids = _item_ids(body.rid, len(prompts), batch)
    stops = params.get("stop") or []
    stops = [stops] if isinstance(stops, str) else [s for s in stops if s]
    if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"sampling_params.stop: at most {MAX_STOP_STRINGS} strings", "stop")
    fields: dict[str, Any] = {k: params[k] for k in _SAME_NAME if params.get(k) is not None}
    preparer.check_token_ids(fields.get("stop_token_ids", []), "sampling_params.stop_token_ids")
    if not fields.get("ignore_eos"):
        # As on the OpenAI endpoints: the tokenizer's end tokens end a generation (and are
        # left out of a text that keeps special tokens).
        stop_ids = fields.get("stop_token_ids", [])
        fields["stop_token_ids"] = stop_ids + sorted(preparer.tokenizer.eos_token_ids - {*stop_ids})
    fields["seed"] = params.get("sampling_seed")
    fields["logit_bias"] = preparer.logit_bias(
        params.get("logit_bias"), "sampling_params.logit_bias"
    )
    fields["grammar"] = _grammar(params)
    prefill_only = params.get("max_new_tokens") == 0
    if prefill_only:
        fields["max_new_tokens"] = 1  # the prompt is computed; its one token is left out
    start = body.logprob_start_len if body.return_logprob else -1
    choices = []
    for index, ids in enumerate(prompts):
        item = dict(fields)
        item.setdefault("max_new_tokens", preparer.room_left(ids))
        where = "sampling_params.max_new_tokens"
        preparer.check_context(len(ids), item["max_new_tokens"], where)
        if start > len(ids):
            raise bad_request(
                f"logprob_start_len ({start}) is past the prompt's {len(ids)} tokens",
                "logprob_start_len",
            )
        if body.return_logprob:
            item["logprobs"] = True
            item["top_logprobs"] = body.top_logprobs_num
            if 0 <= start < len(ids):
                item["prompt_logprobs"] = body.top_logprobs_num
        choices.append(ChoiceSpec(index, ids, _sampling(preparer, item)))
    prepared = PreparedRequest(
        choices=choices,
        prompt_count=len(prompts),
        stop_strings=stops,
        stream=body.stream,
        include_usage=False,
        top_logprobs=body.top_logprobs_num if body.return_logprob else None,
        skip_special_tokens=params.get("skip_special_tokens") is not False,
    )
    shape = GenerateShape(
        batch=batch,
        item_ids=item_ids,
        prefill_only=prefill_only,
        logprobs=body.return_logprob,
        logprob_start_len=start,
        text_in_logprobs=body.return_text_in_logprobs,
    )
    return prepared, shape


def _sampling(preparer: RequestPreparer, fields: dict[str, Any]) -> SamplingParams:
    try:
        return preparer.sampling(fields)
    except APIError as e:
        # The engine names its own field first; here it is one of sampling_params.
        e.param = "sampling_params." + e.message.split(" ", 1)[0]
        raise


def _check_types(params: dict[str, Any]) -> None:
    unknown = sorted(set(params) - set(_TYPES))
    if unknown:
        where = f"sampling_params.{unknown[0]}"
        raise bad_request(f"{where}: not a sampling parameter this server knows", where)
    for name, value in params.items():
        where = f"sampling_params.{name}"
        if value is not None and not _is(value, _TYPES[name]):
            raise bad_request(f"{where}: wrong type ({type(value).__name__})", where)
        if isinstance(value, list) and not all(_is(v, _ITEM_TYPES[name]) for v in value):
            raise bad_request(f"{where}: a list of {_ITEM_TYPES[name][0].__name__}s", where)


def _is(value: Any, types: tuple[type, ...]) -> bool:
    """`value` is one of `types`, where a bool is no number (JSON's true is not 1)."""
    return isinstance(value, types) and isinstance(value, bool) == (bool in types)


def _prompts(preparer: RequestPreparer, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Each prompt's token ids, and whether they came as a batch (a list)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    param = "text" if body.text is not None else "input_ids"
    prompts: list[list[int]]
    if isinstance(body.text, str):
        prompts, batch = [preparer.encode_text(body.text, param)], False
    elif body.text is not None:
        prompts, batch = [preparer.encode_text(t, param) for t in body.text], True
    elif body.input_ids and isinstance(body.input_ids[0], list):
        prompts, batch = [list(ids) for ids in body.input_ids], True
    else:
        prompts, batch = [list(body.input_ids or [])], False  # type: ignore[arg-type]
    if not prompts:
        raise bad_request(f"{param} must not be an empty batch", param)
    if len(prompts) > MAX_CHOICES:
        raise bad_request(f"{param}: at most {MAX_CHOICES} prompts in a batch", param)
    for ids in prompts:
        preparer.check_prompt(ids, param)
    return prompts, batch


def _item_ids(rid: str | list[str] | None, count: int, batch: bool) -> list[str] | None:
    if rid is None:
        return None
    if batch != isinstance(rid, list) or (batch and len(rid) != count):
        raise bad_request(
            "rid: one string for one prompt, a list of as many strings for a batch", "rid"
        )
    return rid if isinstance(rid, list) else [rid]


def _grammar(params: dict[str, Any]) -> GrammarSpec | None:
    given = [k for k in ("json_schema", "regex", "ebnf") if params.get(k) is not None]
    if len(given) > 1:
        raise bad_request(
            f"sampling_params: at most one of json_schema, regex, ebnf (got {given})",
            f"sampling_params.{given[1]}",
        )
    if not given:
        return None
    name = given[0]
    where = f"sampling_params.{name}"
    if name == "json_schema":
        return json_schema_spec(params[name], where)
    return checked(GrammarSpec(name, params[name]), where)


class GenerateFormat(ResponseFormat):
    """SGLang's answer shape: one answer per prompt, a list for a batch."""

    id_prefix = ""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        prepared: PreparedRequest,
        shape: GenerateShape,
        arrival: float,
    ) -> None:
        super().__init__(model, tokenizer, prepared)
        count = len(prepared.choices)
        if shape.item_ids is not None and not shape.batch:
            self.id = shape.item_ids[0]  # the engine's request id too
        # a batch item's default id is the engine's request id of that item
        self._item_ids = shape.item_ids or (
            [f"{self.id}-{i}" for i in range(count)] if shape.batch else [self.id]
        )
        self._shape = shape
        self._arrival = arrival
        self._so_far: dict[int, Delta] = {}

    def chunk(self, delta: Delta) -> dict[str, Any]:
        so_far = self._so_far.setdefault(delta.index, Delta(delta.index))
        so_far.add(delta)
        answer = self._answer(so_far)
        if self._shape.batch:
            answer["index"] = delta.index
        return answer

    def body(self, results: list[Delta]) -> dict[str, Any]:
        """The answer to a request of one prompt (`whole` answers a batch)."""
        return self._answer(results[0])

    def whole(self, results: list[Delta], usage: dict[str, Any], timings: dict[str, Any]) -> Any:
        answers = [self._answer(r) for r in results]
        for answer in answers:
            answer["baton_timings"] = timings
        return answers if self._shape.batch else answers[0]

    def _answer(self, result: Delta) -> dict[str, Any]:
        shape = self._shape
        outputs = Delta(result.index) if shape.prefill_only else result
        meta: dict[str, Any] = {
            "id": self._item_ids[result.index],
            "finish_reason": self._finish(result, outputs.token_ids),
            "prompt_tokens": len(self._prompt_ids(result.index)),
            "completion_tokens": len(outputs.token_ids),
            "cached_tokens": result.cached_tokens,
            "e2e_latency": time.monotonic() - self._arrival,
        }
        if shape.logprobs:
            meta["output_token_logprobs"] = [self._triple(lp) for lp in outputs.logprobs]
            meta["output_top_logprobs"] = [self._top(lp) for lp in outputs.logprobs]
            tokens, tops = self._input_logprobs(result)
            meta["input_token_logprobs"] = tokens
            meta["input_top_logprobs"] = tops
        return {"text": outputs.text, "output_ids": list(outputs.token_ids), "meta_info": meta}

    def _input_logprobs(self, result: Delta) -> tuple[list[Any], list[Any]]:
        """From `logprob_start_len` on; the first prompt token has no logprob (None)."""
        start = self._shape.logprob_start_len
        if start < 0 or not result.prompt_logprobs:
            return [], []
        first = self._prompt_ids(result.index)[0]
        tokens = [[None, first, self._text(first)], *map(self._triple, result.prompt_logprobs)]
        tops = [None, *map(self._top, result.prompt_logprobs)]
        return tokens[start:], tops[start:]

    def _finish(self, result: Delta, tokens: list[int]) -> dict[str, Any] | None:
        reason = result.finish_reason
        if reason is None:
            return None
        if reason == "length" or self._shape.prefill_only:
            return {"type": "length", "length": len(tokens)}
        if reason == "stop" and (result.stop_string is not None or tokens):
            # SGLang names what matched: the stop string, else the stop token
            matched = result.stop_string if result.stop_string is not None else tokens[-1]
            return {"type": "stop", "matched": matched}
        return {"type": reason}

    def _triple(self, lp: TokenLogprob) -> list[Any]:
        return [lp.logprob, lp.token_id, self._text(lp.token_id)]

    def _top(self, lp: TokenLogprob) -> list[list[Any]]:
        return [[logprob, token_id, self._text(token_id)] for token_id, logprob in lp.top]

    def _text(self, token_id: int) -> str | None:
        return self._token_text(token_id) if self._shape.text_in_logprobs else None
