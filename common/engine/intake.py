"""A request as the scheduler takes it in (`Intake.make`): its seed, its stop tokens, its
grammar's matcher, and what is wrong with it, said in its `error` before it ever reaches a
queue. A prompt longer than the context, or longer than the whole KV pool, is refused
here; a request allowed more tokens than the context holds is cut to fit."""

from __future__ import annotations

import random
import time

from baton.common.config import ModelConfig
from baton.common.layers.grammar import GrammarBackend
from baton.common.protocol import out_of_vocab
from baton.common.sampling import SamplingParams
from baton.common.state import Req

__all__ = ["Intake"]


class Intake:
    def __init__(self, model_cfg: ModelConfig, page_size: int, pool_pages: int, seed: int) -> None:
        self.model_cfg = model_cfg
        self.page_size = page_size
        self.pool_pages = pool_pages
        self.grammars = GrammarBackend(
            model_cfg.path, model_cfg.vocab_size, model_cfg.eos_token_ids
        )
        self._rng = random.Random(seed)

    def make(
        self, rid: str, input_ids: list[int], sampling: SamplingParams, received_at: float = 0.0
    ) -> Req:
        """The request, its `error` set where it cannot run."""
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop.update(self.model_cfg.eos_token_ids)
        req = Req(rid, list(input_ids), sampling, seed, frozenset(stop))
        req.times["arrival"] = time.monotonic()
        if received_at:
            req.times["received"] = received_at  # by the worker's frontend
        error = self._check(req)
        if not error and sampling.grammar is not None:
            try:
                req.grammar = self.grammars.matcher(sampling.grammar)
            except ValueError as e:
                error = str(e)
            # A resumed request (migrated by the router) ends with its own earlier output:
            # the grammar continues after it.
            resumed = req.input_ids[len(req.input_ids) - sampling.output_offset :]
            if req.grammar is not None and not all(map(req.grammar.accept, resumed)):
                error = "the resumed output (output_offset) does not match the grammar"
        req.error = error
        return req

    def _check(self, req: Req) -> str:
        n, ctx = len(req.input_ids), self.model_cfg.context_len
        if n == 0:
            return "the prompt is empty"
        if error := out_of_vocab(req.input_ids, self.model_cfg.vocab_size):
            return f"prompt: {error}"
        if n >= ctx:
            return f"the prompt has {n} tokens; the model's context length is {ctx}"
        if n + req.sampling.max_new_tokens > ctx:
            req.sampling = req.sampling.replace(max_new_tokens=ctx - n)
        need = -(-(n + req.sampling.max_new_tokens) // self.page_size)
        if need > self.pool_pages:
            return (
                f"the request needs {n + req.sampling.max_new_tokens} tokens of KV cache; "
                f"the pool holds {self.pool_pages * self.page_size}"
            )
        return ""
