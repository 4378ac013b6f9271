"""A worker's warm-up (services/worker/warm_up.py): before the worker reports ready it has
run each kind of step it will serve, so no kernel compiles in a user's request, and it
leaves nothing behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from baton.common.engine.engine import Engine
from baton.services.worker import warm_up as warm
from baton.services.worker.scheduler_proc import OutputCollector


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
