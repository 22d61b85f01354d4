"""Free latency with an unfinished fence token on another range, with and without the device sync.

    python benchmarks/bench_free_sync.py            # prints a table
    python benchmarks/bench_free_sync.py --json     # the same figures for scripts

On each simulated GPU profile (h200, gb10-128gb, rocm-win-2gpu, wddm-6gb), the
generic VMM backend with the profile's knobs frees a freshly faulted range
while a kernel reading another range is still running (its fence token
recorded), once with the device-wide synchronize after fresh mappings
(``page_in_sync="always"``, what every free after a fault did before issue 17)
and once without (``"never"``), the two sides alternating in rounds in this one
run. Printed per profile: wall time per free (best round) and their ratio; the
device time the free waited (the simulated clock: the sync waits for the other
range's kernel); whether that kernel was still running after the free (the
sync stalls every stream, torch's included); and what the driver did without
the sync (on WDDM the free races the page-in of the fresh mapping: the
bugcheck of ComfyUI #16246, which is why that platform keeps the sync).

The measuring lives in the public module ``membackend.lab.bench`` (``membackend bench`` runs it with the rest).
"""

from __future__ import annotations

import argparse
import json
import sys

from membackend.lab.bench import bench_free_sync, format_free_sync


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer frees per round (a smoke run)")
    args = ap.parse_args(argv)
    rows = bench_free_sync(n=10 if args.quick else 50, rounds=3 if args.quick else 5)
    print(json.dumps(rows, indent=2) if args.json else "\n".join(format_free_sync(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
