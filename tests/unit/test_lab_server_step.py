"""The server-step reader keeps only steady decode intervals: a prompt step, a changing
batch or a queue in an interval leaves it out."""

from baton.benchmarks.lab.server_step import by_batch, parse, steady_intervals


def _s(t: float, steps: int, decode: int, running: int, queued: int = 0):
    return t, {"steps": steps, "decode_graph_steps": decode, "running": running, "queued": queued}


def test_only_steady_decode_intervals_count() -> None:
    samples = [
        _s(0.0, 0, 0, 200, queued=5),  # queued: out
        _s(0.5, 10, 5, 200),  # prompts ran in it: out
        _s(1.0, 40, 35, 200),  # 30 decode steps in 0.5 s: 16.7 ms
        _s(1.5, 70, 65, 200),  # the same
        _s(2.0, 100, 95, 150),  # the batch changed: out
        _s(2.5, 150, 145, 150),  # 50 steps in 0.5 s: 10 ms
    ]
    rows = by_batch(steady_intervals(samples))
    assert [(r["batch"], r["intervals"], r["steps"]) for r in rows] == [(200, 2, 60), (150, 1, 50)]
    assert abs(rows[0]["step_ms"] - 500 / 30) < 1e-9 and abs(rows[1]["step_ms"] - 10) < 1e-9


def test_parse_reads_the_worker_series() -> None:
    text = (
        "baton_worker_steps_total 120.0\n"
        'baton_worker_graph_steps_total{graph="decode"} 100.0\n'
        'baton_worker_graph_steps_total{graph="prompt"} 3.0\n'
        "baton_worker_running 7.0\nbaton_worker_queued 0.0\n"
    )
    assert parse(text) == {"steps": 120, "decode_graph_steps": 100, "running": 7, "queued": 0}
