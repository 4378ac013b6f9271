"""Plots of one `bench serve` run: latency CDFs and throughput over time (PNG).

`sweep_report` plots a sweep across rates and shapes; these show one run from the inside:
how the latencies spread (a CDF per latency: TTFT, TPOT, E2E) and how the load went
(output tokens/s, requests finished/s and requests in flight over the run). Times on the
x axis are seconds from the run's start, as the records' `scheduled_s` are.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from baton.benchmarks.metrics import RequestRecord

PLOTS = ("latency_cdf", "throughput")
# About this many bins over a run, each at least this wide (s).
TIME_BINS, MIN_BIN_S = 60, 0.05


def can_plot() -> bool:
    """matplotlib is installed (the `plot` extra)."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_paths(folder: Path, prefix: str = "") -> list[Path]:
    """Where `write_run_plots` writes: `folder/<prefix>latency_cdf.png`, ..."""
    return [folder / f"{prefix}{name}.png" for name in PLOTS]


def write_run_plots(
    records: list[RequestRecord], folder: Path, prefix: str = "", title: str = ""
) -> list[Path]:
    """Write the run's plots at `plot_paths(folder, prefix)`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cdf_path, throughput_path = plot_paths(folder, prefix)
    done = [r for r in records if r.sent and not r.warmup and r.success]

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    latencies = {
        "TTFT": [r.ttft_s for r in done if r.ttft_s is not None],
        "TPOT": [r.tpot_s for r in done if r.tpot_s is not None],
        "E2E": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    for ax, (name, values) in zip(axes, latencies.items(), strict=True):
        ms = np.sort(np.asarray(values, dtype=np.float64)) * 1000.0
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
            for q in (50, 99):
                ax.axvline(float(np.percentile(ms, q)), ls=":", lw=1, color="gray")
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", title=f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"latency CDFs {title}".strip() + " (dotted: p50, p99)")
    fig.tight_layout()
    fig.savefig(cdf_path, dpi=110)

    fig, (tokens_ax, requests_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    edges, tokens, finished, running = _over_time(records)
    width = edges[1] - edges[0]
    tokens_ax.step(edges[:-1], tokens / width, where="post")
    tokens_ax.set(ylabel="output tokens/s", title=f"throughput over time {title}".strip())
    requests_ax.step(edges[:-1], finished / width, where="post", label="finished / s")
    requests_ax.step(edges[:-1], running, where="post", label="in flight")
    requests_ax.set(xlabel="time from the run's start (s)", ylabel="requests")
    requests_ax.legend()
    for ax in (tokens_ax, requests_ax):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=110)
    plt.close("all")
    return [cdf_path, throughput_path]


def _over_time(
    records: list[RequestRecord],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bin edges (s), output tokens and successful finishes per bin, and requests in flight
    at each bin's start. A chunk's tokens count when it arrived (its share of the
    request's output tokens)."""
    sent = [r for r in records if r.sent and r.finished_s is not None]
    end = max((r.finished_s or 0.0 for r in sent), default=1.0)
    width = max(end / TIME_BINS, MIN_BIN_S)
    edges = np.arange(0.0, end + width, width)
    if edges.size < 2:
        edges = np.array([0.0, width])
    times, weights = [], []
    for r in sent:
        if not r.success or r.ttft_s is None:
            continue
        chunk_times = r.scheduled_s + r.client_queue_s + r.ttft_s + np.cumsum([0.0, *r.itl_s])
        times.extend(chunk_times.tolist())
        weights.extend([r.output_tokens / len(chunk_times)] * len(chunk_times))
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    finish_times = [r.finished_s for r in sent if r.success and r.finished_s is not None]
    finished, _ = np.histogram(finish_times, bins=edges)
    starts = np.array([r.scheduled_s + r.client_queue_s for r in sent])
    ends = np.array([r.finished_s for r in sent], dtype=np.float64)
    running = np.array([int(np.sum((starts <= t) & (ends > t))) for t in edges[:-1]])
    return edges, tokens.astype(np.float64), finished.astype(np.float64), running


def beside(result_json: Path) -> tuple[Path, str]:
    """(folder, prefix) that put the plots beside a results JSON `r.json`:
    `r.latency_cdf.png`, `r.throughput.png`."""
    return result_json.parent, result_json.stem + "."
