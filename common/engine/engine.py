"""Offline engine: `Engine(model_path, **options).generate(input_ids, sampling)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from baton.common.config import EngineConfig, ModelConfig
from baton.common.engine.scheduler import Scheduler
from baton.common.engine.stats import StepStats
from baton.common.engine.tp import start_followers, stop_followers
from baton.common.sampling import SamplingParams
from baton.common.state import GenerateOutput, Req, TokenLogprob


class Engine:
    def __init__(self, model_path: str | Path | None = None, **options: object) -> None:
        if model_path is None:
            from baton.common.models.tiny import default_model_path

            model_path = default_model_path()
        unknown = set(options) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.config = EngineConfig(model_path=str(model_path), **options)  # type: ignore[arg-type]
        self.model_config = ModelConfig.from_pretrained(model_path)
        self._done: dict[str, Req] = {}
        self._followers = start_followers(self.config, self.model_config)
        self.scheduler = Scheduler(self.config, self.model_config, self._on_output)
        self._ids = itertools.count()

    def _on_output(
        self, req: Req, tokens: list[int], lps: list[TokenLogprob], finished: bool
    ) -> None:
        if finished:
            self._done[req.rid] = req

    def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        if sampling is None:
            sampling = SamplingParams()
        params = (
            [sampling] * len(input_ids) if isinstance(sampling, SamplingParams) else list(sampling)
        )
        if len(params) != len(input_ids):
            raise ValueError(f"{len(params)} sampling params for {len(input_ids)} prompts")
        rids = []
        for ids, p in zip(input_ids, params, strict=True):
            rid = f"offline-{next(self._ids)}"
            rids.append(rid)
            self.scheduler.add_request(rid, list(ids), p)
        while any(r not in self._done for r in rids):
            self.scheduler.step()
        outs = []
        for rid in rids:
            req = self._done.pop(rid)
            if req.error:
                raise ValueError(req.error)
            outs.append(
                GenerateOutput(
                    rid=rid,
                    output_ids=list(req.output_ids),
                    finish_reason=req.finish_reason.value if req.finish_reason else "",
                    prompt_tokens=len(req.input_ids),
                    cached_tokens=req.prefix_hit_tokens,
                    logprobs=list(req.logprobs) if req.sampling.logprobs else None,
                    prompt_logprobs=list(req.prompt_logprobs)
                    if req.sampling.prompt_logprobs is not None
                    else None,
                )
            )
        return outs

    def stats(self) -> StepStats:
        return self.scheduler.step_stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def all_pages_free(self) -> bool:
        """True once drained with the prefix cache flushed."""
        radix = self.scheduler.cache.radix
        if radix is not None:
            radix.reset()
        return self.scheduler.allocator.num_free == self.scheduler.allocator.num_pages

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        stop_followers(self._followers)
        self._followers = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
