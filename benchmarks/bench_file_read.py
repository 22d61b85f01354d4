"""Reading a weight's file slice into host memory: one thread against the adapter's reader threads.

    python benchmarks/bench_file_read.py [--mib N]

ComfyUI loads each weight from its file through comfy-aimdo's ``HostBuffer.read_file_slice`` /
``read_file_to_device``; aimdo reads with a pool of 8 ``pread`` threads, and membackend's stand-ins
split a long read into chunks on their reader threads. This reads a file of ``--mib`` MiB (from the
page cache, as on a warm machine) both ways, interleaved, best of three
(:func:`membackend.lab.adapter.file_read`), and prints GB/s for each and their ratio. The gain grows
with the cores the machine has.
"""

from __future__ import annotations

import argparse
import os

from membackend.lab.adapter import file_read


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args(argv)
    figures = file_read(args.mib)
    print(f"reading {args.mib} MiB from the page cache ({os.cpu_count()} cores):")
    for name in ("one thread", "reader threads"):
        print(f"  {name:15} {figures[name]:6.2f} GB/s")
    print(f"  ratio           {figures['ratio']:6.2f}x")


if __name__ == "__main__":
    main()
