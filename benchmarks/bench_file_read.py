"""Reading a weight's file slice into host memory: one thread against the adapter's reader threads.

    python benchmarks/bench_file_read.py [--mib N]

ComfyUI loads each weight from its file through comfy-aimdo's ``HostBuffer.read_file_slice`` /
``read_file_to_device``; aimdo reads with a pool of 8 ``pread`` threads, and membackend's stand-ins
split a long read into chunks on their reader threads (``membackend._comfyui.buffers``). This reads a
file of ``--mib`` MiB (from the page cache, as on a warm machine) both ways, interleaved, best of three,
and prints GB/s for each and their ratio. The gain grows with the cores the machine has.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from membackend._comfyui import buffers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args(argv)
    size = args.mib << 20
    buffers.READ_THREADS_FROM = 1  # measure the reader threads here whatever the cores (the adapter asks 4)
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(1 << 20) * args.mib)
        f.flush()
        hb = buffers.HostBuffer(0, 0, size)
        view = memoryview(hb._map)[:size]
        view[::4096] = b"\1" * len(view[::4096])  # the buffer's pages exist before either read
        best: dict[str, float] = {}
        for _round in range(3):
            for name in ("one thread", "reader threads"):
                start = time.perf_counter()
                if name == "one thread":
                    buffers._pread(f.fileno(), view, 0)
                else:
                    buffers._read_into(f.fileno(), view, 0, "bench")
                rate = size / (time.perf_counter() - start) / 1e9
                best[name] = max(best.get(name, 0.0), rate)
        view.release()
        hb.close()
    print(f"reading {args.mib} MiB from the page cache ({os.cpu_count()} cores):")
    for name, rate in best.items():
        print(f"  {name:15} {rate:6.2f} GB/s")
    print(f"  ratio           {best['reader threads'] / best['one thread']:6.2f}x")


if __name__ == "__main__":
    main()
