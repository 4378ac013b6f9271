"""SGLang's native `POST /generate`: the request it takes and the answer it gives.

    {"text": "..." | "input_ids": [...], "sampling_params": {...}, "stream": bool,
     "return_logprob": bool, "top_logprobs_num": k, "logprob_start_len": n, "rid": "..."}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", ...},
        "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
        "output_token_logprobs", "output_top_logprobs", "input_token_logprobs", ...}}

Streamed, every event carries the text and output ids so far (SGLang's cumulative
stream), the last one the finish reason. `sampling_params` takes SGLang's names; one this
server does not know is a 400 naming it.
"""

from __future__ import annotations

import time
from typing import Any

from baton.common.sampling import GrammarSpec
from baton.common.state import TokenLogprob
from baton.common.tokenizer import Tokenizer
from baton.services.router.errors import bad_request
from baton.services.router.formats import ResponseFormat
from baton.services.router.params import ChoiceSpec, PreparedRequest, RequestPreparer
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
_OTHERS = ("stop", "json_schema", "regex", "ebnf", "logit_bias", "sampling_seed", "n")
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
}


def prepare_generate(preparer: RequestPreparer, body: GenerateRequest) -> PreparedRequest:
    params = body.sampling_params
    unknown = sorted(set(params) - set(_SAME_NAME) - set(_OTHERS))
    if unknown:
        where = f"sampling_params.{unknown[0]}"
        raise bad_request(f"{where}: not a sampling parameter this server knows", where)
    for name, value in params.items():
        if value is not None and (
            not isinstance(value, _TYPES[name]) or isinstance(value, bool) != (bool in _TYPES[name])
        ):
            where = f"sampling_params.{name}"
            raise bad_request(f"{where}: wrong type ({type(value).__name__})", where)
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    if params.get("n", 1) != 1:
        raise bad_request("sampling_params.n: only 1 is supported", "sampling_params.n")
    ids = (
        preparer.tokenizer.encode(body.text)
        if body.text is not None
        else list(body.input_ids or [])
    )
    preparer.check_prompt(ids, "input_ids" if body.text is None else "text")
    stops = params.get("stop") or []
    stops = [stops] if isinstance(stops, str) else [s for s in stops if s]
    if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"sampling_params.stop: at most {MAX_STOP_STRINGS} strings", "stop")
    fields: dict[str, Any] = {k: params[k] for k in _SAME_NAME if params.get(k) is not None}
    fields.setdefault("max_new_tokens", preparer.room_left(ids))
    preparer.check_context(len(ids), fields["max_new_tokens"], "sampling_params.max_new_tokens")
    preparer.check_token_ids(fields.get("stop_token_ids", []), "sampling_params.stop_token_ids")
    fields["seed"] = params.get("sampling_seed")
    fields["logit_bias"] = preparer.logit_bias(
        params.get("logit_bias"), "sampling_params.logit_bias"
    )
    fields["grammar"] = _grammar(params)
    if body.return_logprob:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs_num
        if 0 <= body.logprob_start_len < len(ids):
            fields["prompt_logprobs"] = body.top_logprobs_num
    return PreparedRequest(
        choices=[ChoiceSpec(0, ids, preparer.sampling(fields))],
        prompt_count=1,
        stop_strings=stops,
        stream=body.stream,
        include_usage=False,
        top_logprobs=body.top_logprobs_num if body.return_logprob else None,
        prompt_logprobs=fields.get("prompt_logprobs"),
    )


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
    """SGLang's answer shape; `logprob_start_len` picks where input logprobs begin."""

    id_prefix = ""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        prepared: PreparedRequest,
        body: GenerateRequest,
        arrival: float,
    ) -> None:
        super().__init__(model, tokenizer, prepared)
        if body.rid:
            self.id = body.rid
        self._start = body.logprob_start_len
        self._arrival = arrival
        self._so_far = Delta(0)

    def chunk(self, delta: Delta) -> dict[str, Any]:
        self._so_far.add(delta)
        return self._answer(self._so_far)

    def body(self, results: list[Delta]) -> dict[str, Any]:
        (result,) = results
        return self._answer(result)

    def closing_chunk(self) -> dict[str, Any]:
        return self._answer(self._so_far)

    def finalize(
        self, body: dict[str, Any], usage: dict[str, Any], timings: dict[str, Any]
    ) -> None:
        meta = body["meta_info"]
        meta["prompt_tokens"] = usage["prompt_tokens"]
        meta["completion_tokens"] = usage["completion_tokens"]
        meta["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
        body["baton_timings"] = timings

    def _answer(self, result: Delta) -> dict[str, Any]:
        reason = result.finish_reason
        meta: dict[str, Any] = {
            "id": self.id,
            "finish_reason": None if reason is None else self._finish(result),
            "prompt_tokens": len(self._prompt_ids(0)),
            "completion_tokens": len(result.token_ids),
            "e2e_latency": time.monotonic() - self._arrival,
        }
        if self.top_logprobs is not None:
            meta["output_token_logprobs"] = [_triple(lp) for lp in result.logprobs]
            meta["output_top_logprobs"] = [_top(lp) for lp in result.logprobs]
            if self.prepared.prompt_logprobs is not None and result.prompt_logprobs:
                ids = self._prompt_ids(0)
                entries = [[None, ids[0], None], *(_triple(lp) for lp in result.prompt_logprobs)]
                meta["input_token_logprobs"] = entries[self._start :]
                tops = [None, *(_top(lp) for lp in result.prompt_logprobs)]
                meta["input_top_logprobs"] = tops[self._start :]
        return {"text": result.text, "output_ids": list(result.token_ids), "meta_info": meta}

    def _finish(self, result: Delta) -> dict[str, Any]:
        reason = result.finish_reason or ""
        if reason == "length":
            return {"type": "length", "length": len(result.token_ids)}
        if reason == "stop" and result.token_ids:
            return {"type": "stop", "matched": result.token_ids[-1]}
        return {"type": reason}


def _triple(lp: TokenLogprob) -> list[Any]:
    """SGLang's (logprob, token id, text) triple; text is not returned (None)."""
    return [lp.logprob, lp.token_id, None]


def _top(lp: TokenLogprob) -> list[list[Any]]:
    return [[logprob, token_id, None] for token_id, logprob in lp.top]
