"""GPU attention backends against the torch reference; CUDA graphs on vs off."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from baton.common.attention import create_attention
from baton.common.attention.base import ForwardBatch
from baton.common.cache.kv_pool import KVPool
from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts, staggered_outputs

BACKENDS = [
    b
    for b in ("triton", "flashinfer")
    if b != "flashinfer" or importlib.util.find_spec("flashinfer") is not None
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_model(model_factory):  # type: ignore[no-untyped-def]
    """A tiny Llama with head_dim 64: flashinfer's Hopper kernels take 64, 128 or 256."""
    return model_factory("llama", hidden=256, heads=4, kv_heads=2)


def _setup(
    page_size: int, hq: int, hk: int, d: int, lens: list[tuple[int, int]], dtype: torch.dtype
):  # type: ignore[no-untyped-def]
    """lens: (prefix, extend) per request. Returns pool, batch, q, k, v."""
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    num_pages = sum(-(-(p + e) // page_size) for p, e in lens) + 8
    pool = KVPool(num_pages, page_size, 2, hk, d, dtype, dev)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    table = torch.zeros(len(lens) + 1, 4096, dtype=torch.int64, device=dev)
    pages = list(range(num_pages))
    random.Random(0).shuffle(pages)
    out_loc = []
    for i, (prefix, ext) in enumerate(lens):
        n = -(-(prefix + ext) // page_size)
        mine, pages = pages[:n], pages[n:]
        slots = [mine[j // page_size] * page_size + j % page_size for j in range(prefix + ext)]
        table[i, : prefix + ext] = torch.tensor(slots)
        out_loc += slots[prefix:]
    t = sum(e for _, e in lens)
    batch = ForwardBatch(
        positions=torch.cat([torch.arange(p, p + e) for p, e in lens]).to(dev),
        out_cache_loc=torch.tensor(out_loc, device=dev),
        req_slots=torch.arange(len(lens), device=dev),
        seq_lens=torch.tensor([p + e for p, e in lens], device=dev),
        extend_lens=torch.tensor([e for _, e in lens], device=dev),
        prefix_lens=torch.tensor([p for p, _ in lens], device=dev),
        req_to_token=table,
        seq_lens_list=[p + e for p, e in lens],
        extend_lens_list=[e for _, e in lens],
        prefix_lens_list=[p for p, _ in lens],
    )
    q = torch.randn(t, hq, d, generator=gen).to(dtype).to(dev)
    k = torch.randn(t, hk, d, generator=gen).to(dtype).to(dev)
    v = torch.randn(t, hk, d, generator=gen).to(dtype).to(dev)
    return pool, batch, q, k, v


def _run(name: str, pool: KVPool, batch: ForwardBatch, q, k, v, hq: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """`name`: a backend, or "PREFILL+DECODE" for the two as one (`create_attention`)."""
    prefill, _, decode = name.partition("+")
    backend = create_attention(prefill, decode or prefill, pool, hq, q.shape[-1])
    backend.prepare(batch)
    return backend.forward(q, k, v, 0, batch).float()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["decode", "extend", "mixed"])
@pytest.mark.parametrize(("hq", "hk", "d"), [(8, 8, 64), (32, 8, 128)])
def test_backend_matches_torch_bf16(
    backend: str, page_size: int, mode: str, hq: int, hk: int, d: int
) -> None:
    """mixed: prompt chunks, then decode rows (--enable-mixed-chunk), each half on its own
    kernels (the backend's prompts, the Triton decode kernel)."""
    if mode == "decode":
        lens = [(n, 1) for n in (1, 17, 300, 2048, 5)]
    elif mode == "extend":
        lens = [(0, 33), (100, 20), (0, 1), (64, 200), (7, 9)]
    else:
        lens = [(0, 33), (100, 20), (17, 1), (300, 1), (2048, 1)]
        backend = f"{backend}+triton"
    ref = _run("torch", *_setup(page_size, hq, hk, d, lens, torch.bfloat16), hq)
    out = _run(backend, *_setup(page_size, hq, hk, d, lens, torch.bfloat16), hq)
    err = (out - ref).abs().max().item()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2 and err < 0.1, f"{backend}: max abs {err:.4f}, rel {rel:.4f}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equal_between_backends(gpu_model, backend: str) -> None:
    """float32 where the backend has float32 kernels; flashinfer has none, so bfloat16."""
    prompts = random_prompts([1, 9, 57, 300], vocab=2000, seed=2)
    dtype = "bfloat16" if backend == "flashinfer" else "float32"
    opts = {"device": "cuda", "page_size": 16, "disable_cuda_graph": True, "dtype": dtype}
    with Engine(gpu_model, attention_backend="torch", **opts) as ref:
        expected = [o.output_ids for o in ref.generate(prompts, GREEDY)]
    with Engine(gpu_model, attention_backend=backend, **opts) as eng:
        got = [o.output_ids for o in eng.generate(prompts, GREEDY)]
    if dtype == "float32":
        assert got == expected
        return
    # bfloat16: a different summation order may flip a near-tie after a few tokens, so
    # require the first tokens everywhere and whole sequences for most prompts
    assert all(g[:4] == e[:4] for g, e in zip(got, expected, strict=True)), (got, expected)
    assert sum(g == e for g, e in zip(got, expected, strict=True)) >= len(prompts) // 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_one_prompt_per_step(gpu_model, backend: str) -> None:
    """A step of one prompt (flashinfer: the single-prompt kernel, no plan) against the
    torch backend, as `test_greedy_equal_between_backends` compares them."""
    prompts = random_prompts([300, 57, 1, 130], vocab=2000, seed=4)
    opts = {"device": "cuda", "page_size": 16, "disable_cuda_graph": True, "dtype": "bfloat16"}
    with Engine(gpu_model, attention_backend="torch", **opts) as ref:
        expected = [ref.generate([p], GREEDY)[0].output_ids for p in prompts]
    with Engine(gpu_model, attention_backend=backend, **opts) as eng:
        got = [eng.generate([p], GREEDY)[0].output_ids for p in prompts]
    # bfloat16: the first tokens everywhere (a near-tie may flip later, as there)
    assert all(g[:4] == e[:4] for g, e in zip(got, expected, strict=True)), (got, expected)


def _differences(got: list[list[int]], expected: list[list[int]]) -> str:
    """Each differing output, whole, beside what was expected (for an assertion's message)."""
    return "\n".join(
        f"prompt {i}: got {g}\n          expected {e}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True))
        if g != e
    )


MIXED = [(b, "bfloat16") for b in BACKENDS] + [("triton", "float32")]


@pytest.mark.parametrize(("backend", "dtype"), MIXED)
def test_greedy_mixed_steps(gpu_model, backend: str, dtype: str) -> None:
    """--enable-mixed-chunk, prompts arriving while others decode: steps of prompt chunks
    and decode rows, the rows on the decode kernel (flashinfer's default: Triton's).
    float32: the torch backend's tokens (transformers' own, as the CPU tests show).
    bfloat16 flips near-ties between kernels within the first tokens whether steps are
    mixed or not (2026-11-29, one H200: Triton's 4th token of the 130-token prompt, unmixed
    too), so there mixed steps give the backend's own tokens of unmixed steps."""
    prompts = random_prompts([300, 57, 1, 130, 90], vocab=2000, seed=6)
    opts = {"device": "cuda", "page_size": 16, "disable_cuda_graph": True, "dtype": dtype}
    runs = (
        [("torch", True), (backend, True)]
        if dtype == "float32"
        else [(backend, False), (backend, True)]
    )
    tokens = []
    for name, mixed in runs:
        with Engine(
            gpu_model,
            attention_backend=name,
            enable_mixed_chunk=mixed,
            chunked_prefill_size=64,
            **opts,
        ) as engine:
            tokens.append(staggered_outputs(engine, prompts, GREEDY))
            assert engine.all_pages_free()
    expected, got = tokens
    assert got == expected, _differences(got, expected)


@pytest.mark.parametrize(("backend", "dtype"), MIXED)
def test_piecewise_graphs_same_tokens(gpu_model, backend: str, dtype: str) -> None:
    """Steps with prompt rows (chunks after a cached prefix, several prompts, prompt chunks
    beside decode rows) replayed in pieces between the attentions, against the same steps
    launched layer by layer. float32: the same tokens; bfloat16: GEMMs over the padded rows
    may sum in another order, as for the prompt graphs."""
    prompts = random_prompts([300, 57, 1, 130, 90, 20], vocab=2000, seed=8)
    opts = {
        "device": "cuda",
        "page_size": 16,
        "dtype": dtype,
        "attention_backend": backend,
        "enable_mixed_chunk": True,
        "chunked_prefill_size": 64,
    }
    tokens = []
    for tokens_max in (0, 256):
        with Engine(gpu_model, piecewise_graph_max_tokens=tokens_max, **opts) as engine:
            tokens.append(staggered_outputs(engine, prompts, GREEDY))
            pieces = engine.scheduler.runner.piecewise_graphs
            assert (pieces is None) == (tokens_max == 0)
            if pieces is not None:
                assert engine.stats().piecewise_graph_steps == pieces.replays > 0
            engine.check_integrity()
            assert engine.all_pages_free()
    expected, got = tokens
    if dtype == "float32":
        assert got == expected, _differences(got, expected)
        return
    assert all(g[:4] == e[:4] for g, e in zip(got, expected, strict=True)), (got, expected)
    assert sum(g == e for g, e in zip(got, expected, strict=True)) >= len(prompts) // 2


# (attention backend, decode's where not its default): each decode kernel in graphs
# (flashinfer's default decode is the Triton kernel)
GRAPHED = [(b, None) for b in BACKENDS]
if "flashinfer" in BACKENDS:
    GRAPHED.append(("flashinfer", "flashinfer"))


@pytest.mark.parametrize(("backend", "decode"), GRAPHED)
def test_cuda_graphs_same_tokens(gpu_model, backend: str, decode: str | None) -> None:
    prompts = random_prompts([3, 40, 120, 7, 9, 11, 13], vocab=2000, seed=3)
    opts = {
        "device": "cuda",
        "page_size": 4,
        "attention_backend": backend,
        "decode_attention_backend": decode,
        "dtype": "bfloat16",
    }
    with Engine(gpu_model, disable_cuda_graph=True, **opts) as eager:
        expected = [o.output_ids for o in eager.generate(prompts, GREEDY)]
    with Engine(gpu_model, disable_cuda_graph=False, **opts) as graphed:
        assert graphed.scheduler.runner.graphs is not None
        assert [o.output_ids for o in graphed.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "flashinfer"] or ["none"])
def test_prompt_graphs_same_tokens_and_cache(gpu_model, backend: str) -> None:
    """One prompt a step: the padded prompt graph against the eager forward. A shorter
    prompt after a longer one must reset the padding's KV slots, or the graph would write
    over the longer prompt's cached KV (the last generations read it back)."""
    if backend == "none":
        pytest.skip("flashinfer is not installed")
    prompts = random_prompts([129, 17, 1, 16, 100, 300, 48], vocab=2000, seed=5)
    opts = {"device": "cuda", "page_size": 4, "attention_backend": backend, "dtype": "bfloat16"}
    with Engine(gpu_model, prefill_graph_max_tokens=0, **opts) as eager:
        assert eager.scheduler.runner.prefill_graphs is None
        expected = [eager.generate([p], GREEDY)[0].output_ids for p in prompts]
    with Engine(gpu_model, prefill_graph_max_tokens=256, **opts) as graphed:
        graphs = graphed.scheduler.runner.prefill_graphs
        assert graphs is not None
        got = [graphed.generate([p], GREEDY)[0].output_ids for p in prompts]
        # all but the 300-token prompt and the 1-token one, a step shaped as a decode's
        # (the decode graph runs it)
        assert graphs.replays == 5 and graphed.stats().prompt_graph_steps == 5
        again = [graphed.generate([p], GREEDY)[0].output_ids for p in prompts[:2]]
        assert all(o.cached_tokens > 0 for o in graphed.generate(prompts[:2], GREEDY))
        graphed.check_integrity()
    # bfloat16 GEMMs over the padded rows may sum in another order: as in the tests above
    assert all(g[:4] == e[:4] for g, e in zip(got, expected, strict=True)), (got, expected)
    assert sum(g == e for g, e in zip(got, expected, strict=True)) >= len(prompts) // 2
    assert all(a[:4] == g[:4] for a, g in zip(again, got, strict=False)), (again, got)


def _long(**knobs: float) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, ignore_eos=True, **knobs)  # type: ignore[arg-type]


# every kind of draw a decode graph takes, beside greedy rows in the same batch
DRAWN = [
    _long(temperature=0.0),
    _long(temperature=1.0, seed=11),
    _long(temperature=0.7, top_p=0.9, seed=12),
    _long(temperature=0.8, top_k=50, seed=13),
    _long(temperature=1.0, min_p=0.05, seed=14),
    _long(temperature=0.9, top_k=300, top_p=0.8, min_p=0.02, seed=15),
    _long(temperature=0.7, top_k=1),  # greedy
]


def test_draws_in_decode_graphs_same_tokens(gpu_model) -> None:  # type: ignore[no-untyped-def]
    """Seeded draws in a decode graph (`CudaGraphRunner.draw`) give the tokens the eager
    sampler draws from the same graphs' logits: alone, in batches padded to a captured
    size, and beside greedy rows. A request with penalties takes the eager sampler inside
    a graphed step. (Logits without graphs differ in their last bits, which moves draws.)"""
    prompts = random_prompts([3, 40, 120, 7, 9, 11, 13], vocab=2000, seed=6)
    opts = {"device": "cuda", "page_size": 4, "attention_backend": "triton", "dtype": "bfloat16"}
    penalized = _long(temperature=0.7, repetition_penalty=1.2, seed=16)
    runs = [
        (prompts, DRAWN),  # batches of 7, then fewer as none finish early: padded to 8
        (prompts[:1], DRAWN[2:3]),  # alone: batch size 1
        (prompts[:3], [DRAWN[3], penalized, DRAWN[4]]),  # the eager sampler
    ]
    with Engine(gpu_model, **opts) as eager:
        graphs = eager.scheduler.runner.graphs
        assert graphs is not None
        graphs.plan_draw = lambda rows, num_tokens: None  # type: ignore[method-assign]
        expected = [[o.output_ids for o in eager.generate(p, s)] for p, s in runs]
        assert eager.stats().draw_graph_steps == 0
    with Engine(gpu_model, **opts) as graphed:
        got, draws = [], [0]
        for p, s in runs:
            got.append([o.output_ids for o in graphed.generate(p, s)])
            draws.append(graphed.stats().draw_graph_steps)
    assert got == expected
    # 23 decode steps a run at least; none where a penalized row is in the batch
    assert draws[1] >= 23 and draws[2] - draws[1] >= 23 and draws[3] == draws[2]


def test_common_draw_graphs_are_captured_before_serving(gpu_model) -> None:  # type: ignore[no-untyped-def]
    """Temperature alone and with top-p draw in graphs captured at start, at every batch
    size: a step that first needs one does not stop to capture it while serving."""
    from baton.common.engine.cuda_graph import EARLY_DRAWS

    prompts = random_prompts([3, 40, 120, 7, 9], vocab=2000, seed=8)
    opts = {"device": "cuda", "page_size": 4, "attention_backend": "triton", "dtype": "bfloat16"}
    with Engine(gpu_model, **opts) as engine:
        graphs = engine.scheduler.runner.graphs
        assert graphs is not None
        early = {(bs, kind) for kind in EARLY_DRAWS for bs in graphs.sizes}
        assert early <= {k for k, v in graphs.draw_graphs.items() if v is not None}
        captured = set(graphs.draw_graphs)
        engine.generate(prompts, [DRAWN[1], DRAWN[2], DRAWN[1], DRAWN[0], DRAWN[2]])
        assert engine.stats().draw_graph_steps >= 23
        assert set(graphs.draw_graphs) == captured


def test_a_draw_graph_that_cannot_be_captured_leaves_the_eager_sampler(
    gpu_model, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A draw graph is captured at start or while serving; if that fails, the step and
    every later one sample eagerly, with the same tokens, instead of failing their
    requests."""
    from baton.common.engine import cuda_graph

    capture = cuda_graph.capture_graph

    def no_draw_graphs(forward, pool, mode="global"):  # type: ignore[no-untyped-def]
        if mode == "thread_local":
            raise RuntimeError("capture failed")
        return capture(forward, pool, mode)

    prompts = random_prompts([3, 40, 120], vocab=2000, seed=7)
    opts = {"device": "cuda", "page_size": 4, "attention_backend": "triton", "dtype": "bfloat16"}
    with Engine(gpu_model, **opts) as engine:
        expected = [o.output_ids for o in engine.generate(prompts, DRAWN[1:4])]
    monkeypatch.setattr(cuda_graph, "capture_graph", no_draw_graphs)
    with Engine(gpu_model, **opts) as engine:
        got = [o.output_ids for o in engine.generate(prompts, DRAWN[1:4])]
        assert engine.stats().draw_graph_steps == 0
    assert got == expected


def test_cached_prompts_give_a_fresh_engines_tokens(gpu_model) -> None:  # type: ignore[no-untyped-def]
    """Prompts whose pages the prefix cache holds, with the answers to them, come out as
    in an engine that never saw them. (A step used to write two requests' KV to the same
    slots where a cached prompt's last page was recomputed: which write landed differed
    from one engine to the next; tests/unit/test_prefix_cache_steps.py.)"""
    prompts = random_prompts([3, 40, 120, 7, 9, 11, 13], vocab=2000, seed=6)
    opts = {"device": "cuda", "page_size": 4, "attention_backend": "triton", "dtype": "bfloat16"}
    with Engine(gpu_model, **opts) as fresh:
        expected = [o.output_ids for o in fresh.generate(prompts[:3], GREEDY)]
    for _ in range(3):  # several engines: the memory each finds differs
        with Engine(gpu_model, **opts) as engine:
            engine.generate(prompts, DRAWN)
            engine.generate(prompts[:1], DRAWN[2:3])
            got = engine.generate(prompts[:3], GREEDY)
            engine.check_integrity()
        assert all(o.cached_tokens > 0 for o in got[1:])
        assert [o.output_ids for o in got] == expected


def test_an_engine_shut_down_gives_its_gpu_memory_back(gpu_model) -> None:  # type: ignore[no-untyped-def]
    """Engines one after another in one process (tests, a reference engine beside a
    cluster) each get the GPU's memory: the pool is sized from what is free."""
    opts = {"device": "cuda", "page_size": 16, "disable_cuda_graph": False, "dtype": "bfloat16"}
    sizes = []
    for _ in range(2):
        with Engine(gpu_model, attention_backend="triton", **opts) as eng:
            eng.generate([[5, 6, 7]], GREEDY)
            sizes.append(eng.scheduler.runner.pool.num_pages)
        assert torch.cuda.memory_allocated() < 1 << 30  # the engine still bound: 60+ GiB before
    assert sizes[1] >= 0.95 * sizes[0]
