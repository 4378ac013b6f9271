"""The prefix cache's host-memory tier (issue 43): evicted pages kept in host memory and
loaded back, token-exact, with nothing lost or owned twice on either tier."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from baton.common.cache.allocator import OutOfPages, PageAllocator
from baton.common.cache.host_tier import HostTier
from baton.common.cache.manager import CacheManager
from baton.common.cache.req_to_token import ReqToTokenTable
from baton.common.cache.tiered_radix import TieredRadixCache
from baton.common.config import ConfigError, EngineConfig
from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from baton.common.state import FinishReason, Req
from baton.services import cli, launcher_config
from baton.services.worker.config import worker_config
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.stats import stats_message
from tests.conftest import hf_greedy, random_prompts
from tests.unit.test_disagg_inprocess import assert_drained, make_side, run_pd, shutdown

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def tiers(engine: Engine) -> tuple[int, int]:
    """(device pages the prefix cache holds, host pages it holds)."""
    radix = engine.scheduler.cache.radix
    assert radix is not None and radix.tier is not None
    return radix.total_pages, radix.tier.pages_used


def assert_both_tiers_empty(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.scheduler.cache.pages_in_use() == 0
    assert engine.all_pages_free(), "device pages leaked"
    assert tiers(engine) == (0, 0), "host pages leaked"


@pytest.mark.parametrize("write", ["on-evict", "through"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_prefix_served_from_the_host_tier_equals_transformers(
    tiny_model, write: str, page_size: int
) -> None:
    shared, head = random_prompts([64, 40], vocab=2000, seed=page_size)
    tail_a, tail_b, tail_c = random_prompts([24, 24, 24], vocab=2000, seed=11)
    with Engine(
        tiny_model, page_size=page_size, max_total_tokens=1024, host_kv_tokens=2048,
        host_kv_write=write,
    ) as engine:  # fmt: skip
        radix = engine.scheduler.cache.radix
        assert radix is not None and radix.tier is not None
        engine.generate([shared + head + tail_a], GREEDY)
        engine.generate([shared + tail_b], GREEDY)  # `shared` becomes a node of its own
        engine.generate([[7] * 4], GREEDY)  # (write-through copies wait two launches)
        # the least recently used leaves (head + tail_a, then its output) go to the host:
        # the prompt below then finds `shared` on the device and `head` on the host
        radix.evict((len(head) + len(tail_a) + 8) // page_size)
        assert tiers(engine)[1] >= len(head) // page_size
        on_device, _ = radix.match_prefix(shared + head)
        assert len(on_device) * page_size == len(shared)
        hits = radix.tier.counters.hit_tokens
        partial = shared + head + tail_c
        out = engine.generate([partial], GREEDY)[0]
        assert out.output_ids == hf_greedy(tiny_model, partial, 8)
        assert radix.tier.counters.hit_tokens - hits >= len(head) - page_size
        assert out.cached_tokens >= len(shared) + len(head) - page_size
        # now everything on the host: the whole prefix comes back from there
        radix.evict(radix.evictable_pages)
        assert tiers(engine)[0] == 0
        whole = shared + tail_b + [3, 1, 4]
        out = engine.generate([whole], GREEDY)[0]
        assert out.output_ids == hf_greedy(tiny_model, whole, 8)
        assert out.cached_tokens >= len(shared) + len(tail_b) - page_size
        counters = radix.tier.counters
        assert counters.bytes_to_device > 0 and counters.bytes_to_host > 0
        assert_both_tiers_empty(engine)


def test_constant_offload_and_reload_completes_a_burst_with_no_page_leaked(tiny_model) -> None:
    """A pool of about two requests, 24 requests over 4 shared prefixes: pages move to the
    host and back all the time; every output is token-exact, and both tiers end empty."""
    prefixes = random_prompts([80, 96, 72, 88], vocab=2000, seed=3)
    rng = random.Random(5)
    prompts = [
        rng.choice(prefixes) + random_prompts([rng.randint(4, 30)], 2000, seed=i)[0]
        for i in range(24)
    ]
    with Engine(tiny_model, page_size=4, max_total_tokens=320, host_kv_tokens=512) as engine:
        outs = engine.generate(prompts, GREEDY)
        assert [o.output_ids for o in outs] == [hf_greedy(tiny_model, p, 8) for p in prompts]
        counters = engine.scheduler.cache.radix.tier.counters  # type: ignore[union-attr]
        assert counters.hit_tokens > 0 and counters.dropped_pages > 0
        assert sum(o.cached_tokens for o in outs) > 0
        assert_both_tiers_empty(engine)


def test_a_burst_with_aborts_while_pages_move_leaks_nothing(tiny_model) -> None:
    """The burst above, a third of it aborted at random steps (some while their prefix is
    being loaded): the rest stays token-exact and both tiers end empty."""
    prefixes = random_prompts([80, 96, 72], vocab=2000, seed=13)
    rng = random.Random(7)
    prompts = {
        f"q{i}": rng.choice(prefixes) + random_prompts([rng.randint(4, 30)], 2000, seed=50 + i)[0]
        for i in range(18)
    }
    doomed = set(rng.sample(sorted(prompts), 6))
    with Engine(tiny_model, page_size=4, max_total_tokens=320, host_kv_tokens=384) as engine:
        sched = engine.scheduler
        reqs = {rid: sched.add_request(rid, ids, GREEDY) for rid, ids in prompts.items()}
        while sched.has_work():
            sched.step()
            for rid in sorted(doomed):
                if rng.random() < 0.3 and sched.abort(rid):
                    doomed.discard(rid)
            engine.check_integrity()
        aborted = {rid for rid, r in reqs.items() if r.finish_reason == FinishReason.ABORT}
        assert len(aborted) >= 2
        for rid in sorted(set(reqs) - aborted):
            assert reqs[rid].output_ids == hf_greedy(tiny_model, prompts[rid], 8), rid
        assert sched.cache.radix.tier.counters.hit_tokens > 0  # type: ignore[union-attr]
        assert_both_tiers_empty(engine)


def test_aborts_mid_load_leave_both_tiers_as_they_were(tiny_model) -> None:
    """Requests whose prefix is being loaded back end before the copy ran (admitted, then
    released before any step) or while it runs (aborted after the step that loads it):
    the loaded pages stay cached, nothing leaks, and later requests stay token-exact."""
    prefix = random_prompts([96], vocab=2000, seed=8)[0]
    with Engine(tiny_model, page_size=4, max_total_tokens=256, host_kv_tokens=512) as engine:
        sched, cache = engine.scheduler, engine.scheduler.cache
        radix = cache.radix
        assert radix is not None and radix.tier is not None
        engine.generate([[*prefix, 1, 2, 3]], GREEDY)
        radix.evict(radix.evictable_pages)
        before = tiers(engine)
        # 1. admitted (its load queued), released before any step ran the copy
        req = sched.new_request("mid-load", [*prefix, 4, 5], GREEDY)
        cache.admit(req)
        assert req.cached_len >= 92 and radix.tier.counters.bytes_to_device > 0
        cache.release(req, cache=False)
        engine.check_integrity()
        assert cache.pages_in_use() == 0
        radix.evict(radix.evictable_pages)  # offloaded again, behind the queued load
        assert tiers(engine) == before
        # 2. aborted after the step that loads it was launched, before its results
        sched.add_request("aborted", [*prefix, 6, 7], GREEDY)
        sched.step()
        assert sched.abort("aborted")
        sched.drain()
        engine.check_integrity()
        assert cache.pages_in_use() == 0
        # the pages moved twice without a step between them: still the prefix's KV
        prompt = [*prefix, 8, 9, 10]
        assert engine.generate([prompt], GREEDY)[0].output_ids == hf_greedy(tiny_model, prompt, 8)
        assert_both_tiers_empty(engine)


def test_prefill_worker_serves_a_prefix_from_its_host_tier(tiny_model) -> None:
    """1P1D: P's prefix comes back from P's host tier; D receives it token-exact."""
    p = make_side(
        tiny_model, "prefill", "tcp", page_size=4, max_total_tokens=384, host_kv_tokens=1024
    )
    d = make_side(tiny_model, "decode", "tcp", page_size=4)
    try:
        shared = random_prompts([100], vocab=2000, seed=21)[0]
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        first = [[*shared, 1, 2], *random_prompts([110, 120], vocab=2000, seed=22)]
        outs, _ = run_pd(p, d, first, params)
        assert outs == [hf_greedy(tiny_model, pr, 8) for pr in first]
        radix = p[0].cache.radix
        assert radix is not None and radix.tier is not None
        radix.evict(radix.evictable_pages)  # the whole prefix cache on P's host tier
        again = [[*shared, 3, 4, 5], [*shared[:60], 9, 9, 9]]
        outs, _ = run_pd(p, d, again, params)
        assert outs == [hf_greedy(tiny_model, pr, 8) for pr in again]
        assert radix.tier.counters.hit_tokens >= 96
        assert_drained(p, d)
        assert radix.tier.pages_used == 0, "host pages leaked"
    finally:
        shutdown(p, d)


def test_decode_radix_cache_serves_a_prefix_from_its_host_tier(tiny_model) -> None:
    """1P1D with D's radix cache on a host tier: D loads its prefix back (P writes only
    the rest), and the pages P writes are never ones a copy still reads."""
    p = make_side(tiny_model, "prefill", "tcp", page_size=4)
    d = make_side(
        tiny_model, "decode", "tcp", page_size=4, max_total_tokens=384, host_kv_tokens=1024
    )
    try:
        shared = random_prompts([100], vocab=2000, seed=31)[0]
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        first = [[*shared, 1, 2], *random_prompts([110, 120], vocab=2000, seed=32)]
        outs, _ = run_pd(p, d, first, params)
        assert outs == [hf_greedy(tiny_model, pr, 8) for pr in first]
        radix = d[0].cache.radix
        assert radix is not None and radix.tier is not None
        radix.evict(radix.evictable_pages)  # D's whole prefix cache on its host tier
        again = [[*shared, 3, 4, 5], *random_prompts([150, 140], vocab=2000, seed=33)]
        outs, _ = run_pd(p, d, again, params)
        assert outs == [hf_greedy(tiny_model, pr, 8) for pr in again]
        assert radix.tier.counters.hit_tokens >= 96
        assert_drained(p, d)
        assert radix.tier.pages_used == 0, "host pages leaked"
    finally:
        shutdown(p, d)


def test_a_host_tier_larger_than_the_memory_available_is_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match=r"--host-kv-tokens asks for .* GiB of host memory"):
        Engine(tiny_model, max_total_tokens=256, host_kv_tokens=10**12)


@pytest.mark.parametrize(
    ("opts", "field"),
    [
        ({"host_kv_tokens": -1}, "host_kv_tokens"),
        ({"host_kv_tokens": 64, "disable_radix_cache": True}, "host_kv_tokens"),
        ({"host_kv_write": "later"}, "host_kv_write"),
    ],
)
def test_a_host_tier_that_cannot_work_is_refused(tiny_model, opts, field) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(model_path=str(tiny_model), **opts)


# -- the tree and its copies, under random sequences -----------------------------------
PAGE = 2
serve_ops = st.lists(
    st.one_of(
        st.tuples(st.just("serve"), st.lists(st.integers(1, 3), min_size=1, max_size=12)),
        st.tuples(st.just("keep"), st.lists(st.integers(1, 3), min_size=1, max_size=12)),
        st.tuples(st.just("end"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(1, 8)),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(serve_ops, st.booleans(), st.integers(1, 12), st.integers(0, 12))
def test_every_page_holds_its_tokens_on_whichever_tier(
    sequence, through, host_pages, ahead
) -> None:  # type: ignore[no-untyped-def]
    """A pool whose pages hold their own token ids as 'KV': after each operation and its
    copies, every device and host page of the tree holds the tokens of its key, every
    request reads its own tokens, and no page on either tier is lost or owned twice;
    with up to `ahead` pages copied ahead of eviction."""
    allocator = PageAllocator(12)
    pool = torch.full((12, PAGE), -1, dtype=torch.int64)
    tier = HostTier(pool, host_pages, write_through=through)
    radix = TieredRadixCache(PAGE, allocator.free, tier)
    radix.ahead_limit = ahead
    cache = CacheManager(PAGE, allocator, ReqToTokenTable(8, 64, "cpu"), radix)
    live: list[Req] = []

    def launch() -> None:  # what a step does before its forward
        moves = cache.take_page_moves()
        if moves is not None:
            moves.run()

    def serve(tokens: list[int], keep: bool) -> None:
        r = Req(f"r{len(live)}", tokens, SamplingParams(max_new_tokens=1), 0, frozenset())
        if cache.table.num_free == 0:
            return
        cache.admit(r)
        launch()
        assert pool[r.pages[: r.cached_len // PAGE]].flatten().tolist() == tokens[: r.cached_len]
        try:
            slots = cache.extend(r, len(tokens) - r.device_len)
        except OutOfPages:
            cache.release(r, cache=False)
            return
        launch()  # the copies of the pages evicted for it run before its forward writes
        flat = pool.view(-1)
        flat[torch.as_tensor(slots)] = torch.tensor(tokens[r.cached_len :])
        if keep:
            cache.cache_prefix(r)
            live.append(r)
        else:
            cache.release(r)

    for op, arg in sequence:
        if op in ("serve", "keep"):
            serve(arg, keep=op == "keep")
        elif op == "end" and live:
            cache.release(live.pop(arg % len(live)))
        elif op == "evict":
            radix.evict(arg)
        launch()
        cache.check_integrity(live)
        for node in radix.all_nodes():
            if node.pages:
                assert pool[node.pages].flatten().tolist() == node.key
            if node.host:
                assert tier.buffer[node.host].flatten().tolist() == node.key
        for r in live:
            pages = r.pages[: r.device_len // PAGE]
            assert pool[pages].flatten().tolist() == r.input_ids[: len(pages) * PAGE]
    for r in live:
        cache.release(r)
    radix.reset()
    cache.check_integrity([])
    assert allocator.num_free == 12 and tier.pages_used == 0


def test_worker_metrics_show_the_host_tier(tiny_model) -> None:
    """What an operator reads: hits in tokens, bytes each way, stall time, pages used."""
    prefix = random_prompts([64], vocab=2000, seed=4)[0]
    with Engine(tiny_model, page_size=4, max_total_tokens=512, host_kv_tokens=256) as engine:
        radix = engine.scheduler.cache.radix
        assert radix is not None
        engine.generate([[*prefix, 1]], GREEDY)
        radix.evict(radix.evictable_pages)
        engine.generate([[*prefix, 2]], GREEDY)
        metrics = WorkerMetrics("both")
        metrics.observe_stats(stats_message(engine.scheduler, {}))
        metrics.observe_stats(stats_message(engine.scheduler, {}))  # totals, counted once
        text = generate_latest(metrics.registry).decode()
    assert "baton_worker_host_kv_hit_tokens_total 64.0" in text
    page_bytes = radix.tier.page_bytes  # type: ignore[union-attr]
    assert (
        f'baton_worker_host_kv_moved_bytes_total{{direction="to_device"}} {16 * page_bytes}.0'
        in text
    )
    assert 'baton_worker_host_kv_moved_bytes_total{direction="to_host"}' in text
    assert "baton_worker_host_kv_pages_capacity 64.0" in text
    # the copies' time is counted: a line ending in exactly 0.0 would mean none was (a
    # substring test also refused 0.000148..., a real nonzero stall)
    assert "baton_worker_host_kv_load_stall_seconds_total 0.0\n" not in text


@pytest.mark.parametrize("decode_cache", [False, True])
def test_baton_up_gives_the_tier_to_every_worker_with_a_prefix_cache(
    tiny_model, decode_cache: bool
) -> None:
    """`baton up --host-kv-tokens` starts (flags reach every worker): P gets the tier, and D
    gets it with its radix cache, none without one."""
    argv = ["up", "--prefill", "1", "--decode", "1", "--model", str(tiny_model)]
    argv += ["--host-kv-tokens", "2048", "--host-kv-write", "through"]
    if decode_cache:
        argv.append("--decode-radix-cache")
    plan = launcher_config.plan_cluster(cli.build_parser("up").parse_args(argv))
    tiers = {}
    for process in plan.processes:
        if process.argv[0] in ("prefill", "decode"):
            parsed = cli.build_parser(process.argv[0]).parse_args(process.argv)
            engine = worker_config(parsed, parsed.command).engine
            tiers[parsed.command] = (engine.host_kv_tokens, engine.host_kv_write)
    assert tiers == {
        "prefill": (2048, "through"),
        "decode": (2048 if decode_cache else 0, "through"),
    }
