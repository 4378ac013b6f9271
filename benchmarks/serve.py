"""`baton bench serve`: open-loop load against an OpenAI-compatible HTTP endpoint.

The whole plan - every request's content and send time - is computed before the
first request goes out. A dispatcher then sleeps until each scheduled time and starts
an asyncio task for that request; the tasks never wait on each other, so a slow server
makes requests pile up instead of slowing the arrivals (open loop). If the event loop
is too busy to launch a request on time, the lag is measured and reported, and the
latency still counts from the scheduled time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec
import numpy as np

from baton.benchmarks import datasets, mooncake, presence
from baton.benchmarks.client import (
    Measurement,
    build_payload,
    fetch_model_card,
    open_session,
    send,
)
from baton.benchmarks.config import TRACE_DATASETS, BenchConfig
from baton.benchmarks.datasets import BenchRequest, TextMaker, TokenText
from baton.benchmarks.metrics import RequestRecord, Summary, flat_keys, make_record, summarize
from baton.benchmarks.phase_results import PhaseResult, phase_results
from baton.benchmarks.phases import phase_offsets
from baton.benchmarks.presence import Presence
from baton.benchmarks.progress import RunProgress
from baton.benchmarks.schedule import arrival_offsets, trace_offsets

log = logging.getLogger(__name__)

# Head start between the end of planning and the first scheduled send, so that the
# first launches do not start out late.
START_DELAY_S = 0.05


class BenchError(RuntimeError):
    """The benchmark could not run (no server, no model, unusable dataset, a cluster short
    of the workers it expects)."""


@dataclass(frozen=True)
class Plan:
    """Every request of the run and when to send it (offsets in seconds, ascending)."""

    offsets: list[float]
    requests: list[BenchRequest]
    # mooncake: the share of prompt tokens an unbounded prefix cache could serve
    prefix_reuse: float | None = None


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    summary: Summary
    records: list[RequestRecord]
    started_at: str = ""  # ISO 8601, local time with offset
    tokenizer: str | None = None  # where prompt lengths were counted; None: in words
    stopped: str | None = None  # why the run ended before its schedule did (a signal)
    cluster: Presence | None = None  # the workers /health showed during the run
    prefix_reuse: float | None = None  # Plan.prefix_reuse

    @property
    def partial(self) -> str | None:
        """Why the run measured fewer workers than the cluster started it with."""
        return None if self.cluster is None else self.cluster.partial

    @property
    def phases(self) -> list[PhaseResult]:
        """Each phase's results, of a `--phases` run (else none)."""
        return phase_results(self.records, self.config)

    def to_dict(self) -> dict[str, Any]:
        """Config, aggregates and per-request records as JSON-ready values."""
        config = self.config
        return {
            "date": self.started_at,
            "client": presence.host_description(),
            "config": config.describe(),
            "stopped": self.stopped,
            "partial_cluster": self.partial,
            "cluster": None if self.cluster is None else self.cluster.to_dict(),
            "model": self.model,
            # vLLM's and SGLang's names, flat, next to ours
            "backend": "openai-chat" if config.endpoint == "chat" else "openai",
            "model_id": self.model,
            "tokenizer_id": self.tokenizer,
            "num_prompts": config.num_requests,
            "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
            "burstiness": config.burstiness,
            "max_concurrency": config.max_concurrency,
            "trace_prefix_reuse": self.prefix_reuse,
            **flat_keys(
                self.records, self.summary, config.percentile_metrics, config.metric_percentiles
            ),
            "summary": msgspec.to_builtins(self.summary),
            "phases": [p.to_dict() for p in self.phases] or None,
            "requests": msgspec.to_builtins(self.records),
        }


def make_plan(config: BenchConfig, text: TextMaker = datasets.random_text) -> Plan:
    """The schedule and the requests, deterministic for a given config (and dataset file).
    `text(rng, n)` makes a random prompt of length n (words, or tokens with `TokenText`)."""
    # Its own stream, so that changing the workload does not change the arrivals.
    content_rng = np.random.default_rng([config.seed, 1])
    if config.dataset in TRACE_DATASETS:
        if config.dataset == "mooncake":
            tokenizer = text.tokenizer if isinstance(text, TokenText) else None
            entries = mooncake.trace_entries(config, tokenizer)
        else:
            entries = datasets.trace_entries(config, content_rng, text)
        # Unlike rate-driven runs, a trace without --num-requests is replayed whole.
        limit = None if config.num_requests is None else config.warmup + config.num_requests
        offsets = trace_offsets(
            [e.timestamp for e in entries],
            time_scale=config.time_scale,
            num_requests=limit,
            duration_s=config.duration_s,
        )
        requests = [e.request for e in entries[: len(offsets)]]
        built = [r.prompt for r in requests if isinstance(r.prompt, mooncake.BlockPrompt)]
        return Plan(offsets, requests, mooncake.prefix_reuse(built) if built else None)
    if config.phases and config.duration_s is not None:
        offsets, phase_of = phase_offsets(
            config.phases, config.duration_s, burstiness=config.burstiness, seed=config.seed
        )
        return Plan(offsets, datasets.phased_requests(config, phase_of, content_rng, text))
    offsets = arrival_offsets(
        config.request_rate,
        num_requests=config.planned_requests,
        duration_s=config.duration_s,
        burstiness=config.burstiness,
        seed=config.seed,
    )
    return Plan(offsets, datasets.synthetic_requests(config, len(offsets), content_rng, text))


async def run_benchmark(config: BenchConfig, stop_on_signals: bool = False) -> BenchResult:
    """Run one benchmark to the end and return its results. Raises BenchError if it cannot.

    With `stop_on_signals` (the CLI; main thread only), SIGINT or SIGTERM ends the run
    early instead of losing it: nothing more is launched, running requests finish, and
    the results say so. A second signal abandons the running requests (counted failed)."""
    started_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    # httpx for the cluster's health and model card; the timed requests go through
    # `client.open_session` (aiohttp), whose C parser costs the client a third of the CPU
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    async with (
        httpx.AsyncClient(timeout=timeout, headers=headers) as client,
        open_session(headers, config.request_timeout_s) as session,
    ):
        start = await _whole_cluster(client, config)
        card = await _model_card(client, config)
        model = config.model or str(card.get("id", ""))
        source = config.tokenizer or _folder(config.model) or card.get("root")
        tokens = load_token_text(source, config.trust_remote_code)
        if tokens is None and config.tokenizer is not None:  # asked for, so not ignored
            raise BenchError(f"--tokenizer {config.tokenizer}: no tokenizer loads from there")
        try:
            plan = make_plan(config, tokens or datasets.random_text)
        except (OSError, ValueError) as e:
            raise BenchError(f"dataset: {e}") from e
        if not plan.offsets:
            raise BenchError("the schedule is empty (check --duration and the trace)")
        stop = _Stop()
        with stop.on_signals(enabled=stop_on_signals):
            async with presence.Watch(client, config.base_url, start) as watch:
                records = await _drive(session, config, plan, model, stop)
    summary = summarize(records, config.slo, config.late_threshold_s)
    tokenizer = tokens.name if tokens is not None else None
    return BenchResult(
        config,
        model,
        summary,
        records,
        started_at,
        tokenizer,
        stop.reason,
        watch.presence,
        plan.prefix_reuse,
    )


def _folder(model: str | None) -> str | None:
    """`--model` when it names a local folder: its tokenizer is the model's (as vLLM's)."""
    return model if model is not None and Path(model).is_dir() else None


async def _whole_cluster(client: httpx.AsyncClient, config: BenchConfig) -> presence.Reading:
    """The cluster's /health once every worker it expects has joined; waits up to
    `config.cluster_wait_s` for them, then refuses to measure the cluster without them."""
    reading = await presence.wait_complete(client, config.base_url, config.cluster_wait_s)
    if reading.missing:
        raise BenchError(
            f"refusing to measure a partial cluster: {reading.describe()} after waiting "
            f"{config.cluster_wait_s:g} s (--wait-for-workers)"
        )
    return reading


async def _model_card(client: httpx.AsyncClient, config: BenchConfig) -> dict[str, Any]:
    """The served model's card; only needed when neither --model nor --tokenizer is given."""
    try:
        return await fetch_model_card(client, config.base_url, config.model)
    except (httpx.HTTPError, ValueError) as e:
        if config.model is not None:
            return {"id": config.model}
        raise BenchError(f"cannot list models at {config.base_url}/v1/models: {e}") from e


def load_token_text(source: object, trust_remote_code: bool = False) -> TokenText | None:
    """Exact token lengths with the tokenizer at `source` (a local model folder); None,
    with a warning, when there is none (lengths are then counted in words)."""
    if isinstance(source, str) and source and Path(source).is_dir():
        from transformers import AutoTokenizer

        try:
            loaded = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
            # transformers annotates decode as `str | list[str]`: one list of ids gives a str
            return TokenText(loaded, source)  # type: ignore[arg-type]
        except (OSError, ValueError) as e:
            log.warning("cannot load the tokenizer at %s (%s)", source, e)
    log.warning(
        "no tokenizer (pass --tokenizer, or serve a model folder this machine can read): "
        "prompt lengths are counted in words, not tokens"
    )
    return None


async def _drive(
    session: aiohttp.ClientSession, config: BenchConfig, plan: Plan, model: str, stop: _Stop
) -> list[RequestRecord]:
    """Launch every request at its time (until `stop` fires) and wait for all of them.

    A body is encoded when its request starts (within a millisecond for a 12k-token
    prompt), since a whole trace's bodies would not fit in memory."""
    total = len(plan.offsets)
    encoder = msgspec.json.Encoder()
    records: list[RequestRecord | None] = [None] * total
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = RunProgress(total, enabled=config.progress)
    run_start = time.perf_counter() + START_DELAY_S
    deadline = run_start + (config.duration_s if config.duration_s is not None else math.inf)

    async def one(index: int) -> None:
        scheduled = run_start + plan.offsets[index]
        launched = time.perf_counter()
        warmup = index < config.warmup
        waited = slots is not None and slots.locked()
        if slots is not None:
            await slots.acquire()
        try:
            # Under a concurrency cap the clock starts when the slot frees: the wait is
            # the client's own queue, not the server's latency.
            clock_start = time.perf_counter() if waited else scheduled
            if clock_start > deadline or stop.reason is not None:
                records[index] = RequestRecord(index, warmup, plan.offsets[index], sent=False)
                progress.skipped()
                return
            progress.launched()
            try:
                request = plan.requests[index]
                body = encoder.encode(
                    build_payload(request, config.endpoint, model, config.sampling)
                )
                m = await _send_bounded(session, config, body)
            except asyncio.CancelledError:  # abandoned by a second signal: recorded, not raised
                m = Measurement(error=f"abandoned: {stop.reason}", end_time=time.perf_counter())
            records[index] = make_record(
                index,
                plan.requests[index],
                warmup=warmup,
                scheduled_s=plan.offsets[index],
                run_start=run_start,
                clock_start=clock_start,
                launch_lag_s=max(0.0, launched - scheduled),
                client_queue_s=clock_start - scheduled if waited else 0.0,
                m=m,
            )
            progress.finished(ok=m.ok)
        finally:
            if slots is not None:
                slots.release()

    tasks = stop.tasks
    with progress:
        for index, offset in enumerate(plan.offsets):
            delay = run_start + offset - time.perf_counter()
            if delay > 0 and await stop.wait(delay):
                break
            tasks.append(asyncio.create_task(one(index)))
        for index in range(len(tasks), total):  # stopped: never launched
            offset = plan.offsets[index]
            records[index] = RequestRecord(index, index < config.warmup, offset, sent=False)
            progress.skipped()
        await asyncio.gather(*tasks)
    return [r for r in records if r is not None]


class _Stop:
    """A run's early end: the first SIGINT/SIGTERM stops launching, a second one cancels
    the requests still running."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self._event = asyncio.Event()

    async def wait(self, seconds: float) -> bool:
        """Sleep `seconds`, or less if the run is stopped; True if it is."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), seconds)
        return self._event.is_set()

    def _signal(self, name: str) -> None:
        running = sum(not t.done() for t in self.tasks)
        if self.reason is None:
            self.reason = f"stopped by {name}"
            self._event.set()
            log.warning(
                "%s: launching no more requests; %d running finish (again to abandon them)",
                name, running,
            )  # fmt: skip
            return
        log.warning("%s again: abandoning %d running requests", name, running)
        for task in self.tasks:
            task.cancel()

    @contextlib.contextmanager
    def on_signals(self, enabled: bool) -> Iterator[None]:
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.getsignal(sig) for sig in sigs}
        for sig in sigs:
            loop.add_signal_handler(sig, self._signal, sig.name)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous[sig])


async def _send_bounded(
    session: aiohttp.ClientSession, config: BenchConfig, body: bytes
) -> Measurement:
    """`send` with an overall deadline (the session's timeouts bound each read, not the
    whole)."""
    try:
        return await asyncio.wait_for(send(session, config.url, body), config.request_timeout_s)
    except asyncio.TimeoutError:
        message = f"timed out after {config.request_timeout_s:g} s"
        return Measurement(error=message, end_time=time.perf_counter())
