"""A worker's warm-up (services/worker/warm_up.py): before the worker reports ready it has
run each kind of step it will serve, so no kernel compiles in a user's request, and it
leaves nothing behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.disagg.start import start_role
from baton.common.engine.engine import Engine
from baton.common.sampling import SamplingParams
from baton.common.step_times import StepTimes
from baton.services.worker import warm_up as warm
from baton.services.worker.collector import OutputCollector
from baton.services.worker.stats import stats_message
from tests.conftest import hf_greedy, random_prompts
from tests.unit.test_disagg_inprocess import assert_drained, make_side, run_pd, shutdown


@pytest.fixture
def engine(tiny_model):  # type: ignore[no-untyped-def]
    with Engine(tiny_model, page_size=4, max_total_tokens=2048) as e:
        yield e


def test_warm_up_leaves_no_trace(engine, caplog) -> None:  # type: ignore[no-untyped-def]
    collector = OutputCollector()
    engine.scheduler.sink = collector
    with caplog.at_level("INFO", logger="baton.scheduler"):
        warm.warm_up(engine.scheduler, collector)
    # an operator sees it begin (a cold GPU compiles for a minute) and end
    assert "warming up:" in caplog.text and "warmed up:" in caplog.text
    assert collector.take() == [] and not engine.scheduler.has_work()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages
    assert engine.stats().prefix_hit_tokens > 0  # the cached-prefix wave found its prefix


def role_side(model, role: str):  # type: ignore[no-untyped-def]
    """A worker's scheduler and role, built as its scheduler process builds them."""
    cfg = EngineConfig(model_path=str(model), role=role, page_size=16, max_total_tokens=8192)
    collector = OutputCollector()
    transfer = TransferConfig(backend="tcp")
    scheduler, handler = start_role(
        role, cfg, ModelConfig.from_pretrained(model), collector, transfer
    )
    return scheduler, handler, collector


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_warm_up_leaves_no_trace_on_every_role(tiny_model, role: str) -> None:  # type: ignore[no-untyped-def]
    """A prefill worker never decodes: a warm-up request that went on past its first token
    stayed there for good, its unaligned last page in use (a 1P1D cluster on GPUs never
    went idle: P reported `pages_in_use: 2`) and its prefix locked in the cache."""
    scheduler, handler, collector = role_side(tiny_model, role)
    try:
        warm.warm_up(scheduler, collector)
        stats = stats_message(scheduler, handler.stats())
        assert (stats.running, stats.queued, stats.pages_in_use, stats.pages_cached) == (0,) * 4
        assert not scheduler.requests and not scheduler.has_work() and not handler.has_work()
        scheduler.check_integrity()
        assert scheduler.allocator.num_free == scheduler.allocator.num_pages
        assert stats.prefix_hit_tokens > 0  # the cached-prefix wave found its prefix
        # compiling steps are no measure of the worker's: no step time is kept from them
        assert stats.step_times == StepTimes() and not scheduler.clock.prefill.ready
    finally:
        handler.shutdown()
        scheduler.shutdown()


def test_a_warm_up_that_leaves_pages_fails_the_start(tiny_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A worker that would serve with pages it can never free does not start."""
    scheduler, handler, collector = role_side(tiny_model, "prefill")
    two = SamplingParams(temperature=0.0, max_new_tokens=2)  # P never decodes the second
    monkeypatch.setattr(warm, "waves", lambda s: [[(list(range(1, 21)), two)]])
    try:
        with pytest.raises(
            RuntimeError, match=r"left 2 pages held and requests \['baton-warmup-0-0'\]"
        ):
            warm.warm_up(scheduler, collector)
    finally:
        handler.shutdown()
        scheduler.shutdown()


def test_warmed_up_prefill_and_decode_go_idle_after_a_pd_run(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """tests/gpu/test_gpu_disagg.py on a CPU: both workers warmed up as on a GPU, then the
    same prompts over ipc (doorbells too: no checksums, as in that cluster); greedy tokens
    are transformers', and both hold nothing after."""
    p = make_side(tiny_model, "prefill", "auto", False, page_size=16, max_total_tokens=8192)
    d = make_side(tiny_model, "decode", "auto", False, page_size=16, max_total_tokens=8192)
    try:
        for scheduler, _, sink in (p, d):
            scheduler.sink = collector = OutputCollector()
            warm.warm_up(scheduler, collector)
            scheduler.sink = sink
        prompts = random_prompts([5, 60, 300, 700], vocab=2000, seed=11)
        params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        outs, _ = run_pd(p, d, prompts, params)
        assert outs == [hf_greedy(tiny_model, pr, 16) for pr in prompts]
        assert p[1].stats()["kv_connections_ipc"] >= 1
        for scheduler, handler, _ in (p, d):
            stats = stats_message(scheduler, handler.stats())
            assert (stats.running, stats.queued, stats.pages_in_use) == (0, 0, 0)
        assert_drained(p, d)
    finally:
        shutdown(p, d)


def test_warm_up_runs_every_kind_of_step(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A prompt alone, two in one step, one with a cached prefix, sampled rows, and a
    decode step larger than the largest graph (here: 5 rows)."""
    monkeypatch.setattr(warm, "eager_decode_size", lambda scheduler: 5)
    seen: list[tuple[bool, int, bool]] = []
    attn = engine.scheduler.runner.attn
    prepare = attn.prepare

    def record(batch):  # type: ignore[no-untyped-def]
        seen.append((batch.is_decode, batch.batch_size, any(batch.prefix_lens_list)))
        return prepare(batch)

    monkeypatch.setattr(attn, "prepare", record)
    collector = OutputCollector()
    engine.scheduler.sink = collector
    warm.warm_up(engine.scheduler, collector)
    prompts = [(bs, prefix) for decode, bs, prefix in seen if not decode]
    assert (1, False) in prompts  # alone: flashinfer's single-prompt kernel
    assert any(bs >= 2 and not prefix for bs, prefix in prompts)  # the ragged kernel
    assert any(prefix for _, prefix in prompts)  # the paged kernel
    assert any(decode and bs >= 5 for decode, bs, _ in seen)  # one eager decode step
    assert collector.take() == [] and not engine.scheduler.has_work()


@pytest.mark.parametrize("role", ["both", "decode"])
def test_warm_up_mixes_a_prompt_with_decode_rows(tiny_model, role: str) -> None:  # type: ignore[no-untyped-def]
    """Where a worker mixes a prompt into its decode steps (--enable-mixed-chunk; a decode
    worker computing a prompt itself, which always does), the warm-up runs such steps
    with 1 to 17 decode rows beside a long context (the decode kernel's split count and
    the eager tail specialize on them), and leaves nothing behind. A decode worker's TPOT
    SLO does not bound them: warm-up steps compile kernels, their times are no measure (an
    SLO no step could keep here)."""
    cfg = EngineConfig(
        model_path=str(tiny_model),
        role=role,
        page_size=16,
        max_total_tokens=8192,
        enable_mixed_chunk=role == "both",
        tpot_slo=1e-9,
    )
    collector = OutputCollector()
    scheduler, handler = start_role(
        role, cfg, ModelConfig.from_pretrained(tiny_model), collector, TransferConfig(backend="tcp")
    )
    seen: list[int] = []
    contexts: list[int] = []
    attn = scheduler.runner.attn
    prepare = attn.prepare

    def record(batch):  # type: ignore[no-untyped-def]
        lens = batch.extend_lens_list
        if any(n > 1 for n in lens) and 1 in lens:
            seen.append(lens.count(1))
            contexts.append(max(batch.seq_lens_list))
        return prepare(batch)

    attn.prepare = record
    try:
        warm.warm_up(scheduler, collector)
        assert set(warm.MIXED_ROWS) <= set(seen), seen
        assert scheduler.stats.mixed_steps == len(seen)  # what the warm-up's log counts
        assert min(contexts) > 8192 // 8, contexts  # a long row beside each (pool / 8 here)
        stats = stats_message(scheduler, handler.stats())
        assert (stats.running, stats.queued, stats.pages_in_use) == (0, 0, 0)
    finally:
        handler.shutdown()
        scheduler.shutdown()


def test_an_eager_decode_wave_only_where_the_worker_admits_it() -> None:
    def scheduler(max_running: int, max_bs: int | None, pages: int) -> SimpleNamespace:
        graphs = None if max_bs is None else SimpleNamespace(max_bs=max_bs)
        return SimpleNamespace(
            runner=SimpleNamespace(graphs=graphs),
            cfg=SimpleNamespace(max_running_requests=max_running, page_size=1),
            allocator=SimpleNamespace(num_pages=pages),
        )

    assert warm.eager_decode_size(scheduler(256, 128, 262144)) == 129
    assert warm.eager_decode_size(scheduler(128, 128, 262144)) == 0  # every step fits a graph
    assert warm.eager_decode_size(scheduler(256, None, 262144)) == 0  # no graphs: all eager
    assert warm.eager_decode_size(scheduler(256, 128, 4096)) == 0  # too few pages to spare
