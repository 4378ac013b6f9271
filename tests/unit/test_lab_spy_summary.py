"""The py-spy summary that says where a profiled thread's time went."""

from __future__ import annotations

from baton.benchmarks.lab.spy_summary import frame_name, summarize

RAW = [
    "thread (1): MainThread;main (/x/run.py:5);step (/y/engine/scheduler.py:9) 30\n",
    "thread (1): MainThread;main (/x/run.py:5);wait (/z/streams.py:254) 10\n",
    "thread (2): forward;execute (/y/model_runner.py:197);linear (/y/skinny.py:352) 60\n",
    "garbage without a count\n",
]


def test_each_thread_counts_its_samples_in_full_and_at_the_top() -> None:
    threads = summarize(RAW)
    samples, inclusive, own = threads["thread (1): MainThread"]
    assert samples == 40
    assert inclusive["main (run.py:5)"] == 40
    assert own == {"step (scheduler.py:9)": 30, "wait (streams.py:254)": 10}
    assert threads["thread (2): forward"][2] == {"linear (skinny.py:352)": 60}


def test_within_keeps_the_stacks_through_a_frame() -> None:
    threads = summarize(RAW, within="step")
    assert list(threads) == ["thread (1): MainThread"]
    assert threads["thread (1): MainThread"][0] == 30


def test_a_frame_keeps_its_file_name_alone() -> None:
    assert frame_name("f (/a/b/c.py:3)") == "f (c.py:3)"
    assert frame_name("<module> (<frozen runpy>:88)") == "<module> (<frozen runpy>:88)"
