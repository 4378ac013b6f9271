"""Where a py-spy profile's samples went, per thread (a diagnostic).

    py-spy record --threads [--gil] --format raw -o spy.txt -- python -m ...
    python -m baton.benchmarks.lab.spy_summary spy.txt [--within chunk_steps] [--top 30]

py-spy's raw format is one line per distinct stack, `frame;frame;...;frame COUNT`, its
first frame the thread (with `--threads`). For each thread: its samples, then the functions
that held the most of them, in full (inclusive) and at the top of the stack (self). A
frame's file is cut to its name. `--within TEXT`: only stacks with a frame containing TEXT.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict

_FILE = re.compile(r" \((?:[^()]*/)?([^/()]*)\)$")


def frame_name(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py:12)`."""
    return _FILE.sub(r" (\1)", frame)


def summarize(
    lines: list[str], within: str | None = None
) -> dict[str, tuple[int, Counter[str], Counter[str]]]:
    """thread -> (samples, inclusive counts, self counts)."""
    threads: dict[str, list] = defaultdict(lambda: [0, Counter(), Counter()])
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        if within is not None and not any(within in f for f in frames[1:]):
            continue
        n = int(count)
        entry = threads[frames[0]]
        entry[0] += n
        for f in set(frames[1:]):
            entry[1][f] += n
        entry[2][frames[-1]] += n
    return {t: (e[0], e[1], e[2]) for t, e in threads.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", help="py-spy record --format raw output")
    ap.add_argument("--within", help="only stacks with a frame containing this")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with open(args.raw) as f:
        threads = summarize(f.readlines(), args.within)
    total = sum(n for n, _, _ in threads.values()) or 1
    for thread, (n, inclusive, own) in sorted(threads.items(), key=lambda t: -t[1][0]):
        print(f"## {thread}: {n} samples ({100 * n / total:.0f}%)")
        for title, counts in (("inclusive", inclusive), ("self", own)):
            print(f"{title}:")
            for frame, c in counts.most_common(args.top):
                print(f"  {c:7d} {100 * c / n:5.1f}%  {frame}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
