"""Core benchmarks: every figure is a ratio of two things measured side by side in this run.

    python benchmarks/bench_core.py            # prints a table
    python benchmarks/bench_core.py --json     # the same figures for scripts

1. Hot path: ``Session.fault`` on an already-resident page and ``Session.free``
   of nothing, each against calling the backend's method directly (and, for
   orientation, against pluggy's generic dispatch). Targets <= 1.2x (fault), <= 1.25x (free).
2. Host fault throughput on 1 GiB in 32 MiB pages against memset over
   already-resident memory (the zeroing limit). Target >= 0.35.
3. One fault+free with 100k pages alive against 1k pages alive. Target <= 1.5.

Timings interleave the two sides and keep the best of several rounds, since
this machine is shared and noisy. The measuring lives in the public module
``membackend.lab.bench`` (``membackend bench`` runs these with the free-sync and
start-up benchmarks and the replays).
"""

from __future__ import annotations

import argparse
import json
import sys

from membackend.lab.bench import (
    GiB,
    MiB,
    bench_fault_throughput,
    bench_hot_path,
    bench_pages_alive,
    core_entries,
    format_core,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (for a smoke run)")
    args = ap.parse_args(argv)
    n = 2_000 if args.quick else 20_000
    hot = bench_hot_path(n)
    thr = bench_fault_throughput(256 * MiB if args.quick else GiB)
    alive = bench_pages_alive(n=200 if args.quick else 2_000)
    if args.json:
        print(json.dumps({"hot_path": hot, "throughput": thr, "pages_alive": alive}, indent=2))
        return 0
    print("\n".join(format_core(core_entries(hot, thr, alive))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
