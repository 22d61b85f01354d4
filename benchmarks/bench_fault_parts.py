"""Where ``Session.fault``'s time over the backend's method goes, part by part (issue 44).

    python benchmarks/bench_fault_parts.py            # 200 rounds of 5,000 calls per row
    python benchmarks/bench_fault_parts.py --rounds 20

Each row is the verb's body rebuilt up to one more of its parts, in the order ``membackend/_session/hot.py``
runs them, then ``Session.fault`` itself, each measured against the host backend's own method for the same
resident page, in alternating rounds (each side's best round). The measuring lives in the public module
``membackend.lab.bench`` (:func:`bench_fault_parts`).
"""

from __future__ import annotations

import argparse
import sys

from membackend.lab.bench import bench_fault_parts, format_fault_parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200, help="rounds per row (default 200)")
    ap.add_argument("--calls", type=int, default=5000, help="calls per round (default 5000)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        ap.error("--rounds and --calls take a whole number >= 1")
    print("\n".join(format_fault_parts(bench_fault_parts(args.rounds, args.calls))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
