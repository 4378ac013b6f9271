"""A worker's scheduler-side output sink: one step's outputs gathered into one message for
the frontend (`OutputCollector`), with each finished request's per-phase timings
(`request_timings`)."""

from __future__ import annotations

import time

from baton.common.protocol import SpansOut, TokenOut
from baton.common.state import Req, TokenLogprob

__all__ = ["OutputCollector", "request_timings"]


class OutputCollector:
    """Collects one step's outputs, to send them as a single message. A request's timings
    are taken with the message that carries its finish, and its first token's `emit` stamp
    when the message that carries it is taken (just before it is sent)."""

    def __init__(self) -> None:
        self.items: dict[str, TokenOut] = {}
        self.spans: list[SpansOut] = []  # of traced requests that finished
        self._first: list[Req] = []  # requests whose first token is among the items
        self._finished: list[tuple[TokenOut, Req]] = []

    def __call__(
        self, req: Req, tokens: list[int], lps: list[TokenLogprob], finished: bool
    ) -> None:
        out = self.items.get(req.rid)
        if out is None:
            out = self.items[req.rid] = TokenOut(req.rid, [], [])
        out.token_ids.extend(tokens)
        out.logprobs.extend(lps)
        if tokens and len(req.output_ids) == 1:
            self._first.append(req)
            if req.prompt_logprobs:
                # with the first token (on P in PD, which returns it to the router)
                out.prompt_logprobs = list(req.prompt_logprobs)
        out.completion_tokens = len(req.output_ids)
        if finished:
            out.finished = True
            out.finish_reason = req.finish_reason.value if req.finish_reason else ""
            out.error = req.error
            out.prompt_tokens = len(req.input_ids)
            out.cached_tokens = req.prefix_hit_tokens
            self._finished.append((out, req))
            if req.trace is not None:
                self.spans.append(SpansOut(req.rid, req.trace.traceparent, req.trace.take()))

    def take(self) -> list[TokenOut]:
        now = time.monotonic()
        for req in self._first:
            req.times["first_token_sent"] = now
        for out, req in self._finished:
            out.timings = request_timings(req)
        self._first.clear()
        self._finished.clear()
        items = list(self.items.values())
        self.items.clear()
        return items

    def take_spans(self) -> list[SpansOut]:
        spans, self.spans = self.spans, []
        return spans


def request_timings(req: Req) -> dict[str, float]:
    """Seconds per phase on this worker: `ingress` (the frontend got the request → the
    scheduler took it off its socket, which it does between steps), `queue`, `prefill`
    (to the first token's stamp, once its step's results are processed) and `emit` (that
    stamp → its message taken to be sent), then the transfer's phases."""
    t = req.times
    out = {}
    if "received" in t:
        out["ingress"] = max(0.0, t["arrival"] - t["received"])
    if "admitted" in t:
        out["queue"] = t["admitted"] - t["arrival"]
    if "first_token" in t and "admitted" in t:
        out["prefill"] = t["first_token"] - t["admitted"]
    if "first_token_sent" in t and "first_token" in t:
        out["emit"] = t["first_token_sent"] - t["first_token"]
    for key in ("kv_transfer", "decode_admission"):
        if key in t:
            out[key] = t[key]
    return out
