"""Loopback KV transfer throughput: GB/s and regions per room, per backend and prompt size.

One prefill and one decode manager in this process, each over its own KV pool sized to the
request (Llama-like layout by default: 32 layers x 8 kv heads x 128 head_dim, bf16, page
size 16, so 128 KiB of KV per token). A timed transfer is one room: send every page, finish,
wait for the receiver's Success (median of ``--repeat`` rooms after one warm-up room). The
limit shown beside it is the best of several plain ``dst.copy_(src)`` of the same bytes.

Two page patterns: ``contiguous`` (both sides one run: one region per room) and
``fragmented`` (destination pages in shuffled blocks of 8, as a busy allocator gives out).

    python -m baton.benchmarks.micro.kv_transfer                  # tcp, ucx, ipc; 128/2048/16384 tokens
    python -m baton.benchmarks.micro.kv_transfer --tokens 2048 --backends tcp --repeat 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from baton.common.devices import shared_host_zeros
from baton.common.transfer.base import Deadlines, KVPoll, KVRoomHandle
from baton.common.transfer.testing import backend_unusable, manager_pair, wait_for

BLOCK_PAGES = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="tcp,ucx,ipc")
    parser.add_argument("--tokens", default="128,2048,16384")
    parser.add_argument("--patterns", default="contiguous,fragmented")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="transfer threads per destination")
    parser.add_argument(
        "--max-gib", type=float, default=4.0, help="skip sizes whose two pools exceed this"
    )
    parser.add_argument("--device", default="cpu", help="where the KV pools live (cpu, cuda:0)")
    parser.add_argument("--out", default="benchmarks/results/kv_transfer.json")
    return parser.parse_args()


def pool(pages: int, page_elems: int, device: str, seed: int | None) -> torch.Tensor:
    """A bf16 pool of ``pages`` pages; filled with a tiled random block (cheap at GiB sizes)."""
    if device == "cpu":  # a memfd, as a worker's pool is (the ipc backend maps it)
        nbytes = pages * page_elems * torch.bfloat16.itemsize
        flat = shared_host_zeros(nbytes).view(torch.bfloat16)
    else:
        flat = torch.zeros(pages * page_elems, dtype=torch.bfloat16, device=device)
    if seed is not None:
        raw = flat.view(torch.uint8)
        generator = torch.Generator().manual_seed(seed)
        block = torch.randint(0, 256, (1 << 20,), generator=generator).to(torch.uint8).to(device)
        for start in range(0, raw.numel(), block.numel()):
            chunk = raw[start : start + block.numel()]
            chunk.copy_(block[: chunk.numel()])
    return flat.view(pages, page_elems)


def destination_pages(pages: int, pattern: str, rng: random.Random) -> list[int]:
    if pattern == "contiguous":
        return list(range(pages))
    blocks = [list(range(b, min(b + BLOCK_PAGES, pages))) for b in range(0, pages, BLOCK_PAGES)]
    rng.shuffle(blocks)
    return [page for block in blocks for page in block]


def same_pages(dst: torch.Tensor, src: torch.Tensor, dst_pages: list[int]) -> bool:
    picks = sorted({0, len(dst_pages) // 2, len(dst_pages) - 1})
    return all(
        torch.equal(dst[dst_pages[i]].view(torch.uint8), src[i].view(torch.uint8)) for i in picks
    )


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, repeat: int) -> float:
    """The limit: best of several ``dst.copy_(src)`` (at least ``repeat``, up to ~1 s)."""
    dst.copy_(src)  # warm-up: first touch of every page
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeat or (spent < 1.0 and runs < 50):
        if dst.is_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - began
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return src.numel() * src.element_size() / best / 1e9


def transfer_runs(
    backend: str,
    src: torch.Tensor,
    dst: torch.Tensor,
    page_bytes: int,
    dst_pages: list[int],
    repeat: int,
    threads: int,
) -> tuple[list[float], int]:
    """Seconds per room (warm-up excluded) and regions per room."""
    deadlines = Deadlines(bootstrap_s=60, waiting_s=60, transferring_s=300)
    times, regions = [], 0
    with manager_pair(
        backend, src, dst, page_bytes, deadlines=deadlines, transfer_threads=threads
    ) as (prefill, decode):
        for attempt in range(repeat + 1):
            dst.view(torch.uint8).zero_()  # untimed: the check below must see new bytes
            room = random.getrandbits(63)
            receiver = decode.create_receiver(room, prefill.control_address)
            receiver.init(dst_pages)
            sender = prefill.create_sender(room, decode.control_address)

            def bootstrapped(handle: KVRoomHandle = sender) -> bool:
                return handle.poll() == KVPoll.WaitingForInput

            if not wait_for(bootstrapped, 30):
                raise RuntimeError(f"{backend}: no bootstrap ({sender.failure_reason})")
            began = time.perf_counter()
            sender.send(list(range(len(dst_pages))), 0)
            sender.finish(b"")
            while not receiver.poll().terminal:
                time.sleep(0.0002)
            elapsed = time.perf_counter() - began
            if receiver.poll() != KVPoll.Success:
                raise RuntimeError(f"{backend}: room failed: {receiver.failure_reason}")
            if not same_pages(dst, src, dst_pages):
                raise RuntimeError(f"{backend}: destination pages differ from the source")
            regions = sender.regions
            receiver.release()
            sender.release()
            if attempt:
                times.append(elapsed)
    return times, regions


def main() -> None:
    args = parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    backends = args.backends.split(",")
    patterns = args.patterns.split(",")
    page_elems = args.layers * 2 * args.page_size * args.kv_heads * args.head_dim
    page_bytes = page_elems * 2
    skipped = {name: reason for name in backends if (reason := backend_unusable(name))}
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    print(HEADER)
    for tokens in tokens_list:
        pages = -(-tokens // args.page_size)
        nbytes = pages * page_bytes
        if 2 * nbytes > args.max_gib * 2**30:
            print(f"skip {tokens} tokens: two pools of {nbytes / 2**30:.1f} GiB > --max-gib")
            continue
        src = pool(pages, page_elems, args.device, seed=1)
        dst = pool(pages, page_elems, args.device, seed=None)
        limit = copy_gbps(src, dst, args.repeat)
        for pattern in patterns:
            dst_pages = destination_pages(pages, pattern, rng)
            for backend in backends:
                row: dict[str, Any] = {
                    "backend": backend,
                    "tokens": tokens,
                    "pattern": pattern,
                    "pages": pages,
                    "bytes": nbytes,
                    "copy_gbps": round(limit, 3),
                }
                if backend in skipped:
                    row["skipped"] = skipped[backend]
                else:
                    times, regions = transfer_runs(
                        backend, src, dst, page_bytes, dst_pages, args.repeat, args.threads
                    )
                    median = statistics.median(times)
                    row.update(
                        regions_per_room=regions,
                        seconds=[round(t, 5) for t in times],
                        gbps=round(nbytes / median / 1e9, 3),
                        of_copy=round(nbytes / median / 1e9 / limit, 3),
                    )
                rows.append(row)
                print_row(row)
        del src, dst
    write(args, rows, page_bytes)


HEADER = (
    f"{'backend':8} {'tokens':>7} {'pattern':11} {'MiB':>7} {'regions':>8} "
    f"{'GB/s':>7} {'copy_ GB/s':>10} {'of copy':>8}"
)


def print_row(row: dict[str, Any]) -> None:
    if "skipped" in row:
        print(
            f"{row['backend']:8} {row['tokens']:>7} {row['pattern']:11} skipped: {row['skipped']}"
        )
        return
    print(
        f"{row['backend']:8} {row['tokens']:>7} {row['pattern']:11} "
        f"{row['bytes'] / 2**20:>7.0f} {row['regions_per_room']:>8} {row['gbps']:>7.2f} "
        f"{row['copy_gbps']:>10.2f} {row['of_copy']:>8.0%}"
    )


def write(args: argparse.Namespace, rows: list[dict[str, Any]], page_bytes: int) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{os.cpu_count()}-core {platform.machine()} CPU, loopback"
        if args.device == "cpu"
        else torch.cuda.get_device_name(args.device),
        "layout": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": "bfloat16",
            "page_bytes": page_bytes,
        },
        "repeat": args.repeat,
        "transfer_threads": args.threads,
        "torch": torch.__version__,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
