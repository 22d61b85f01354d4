"""GPU figures for the VMM backend on a real CUDA device (run by scripts/gpu-check).

1. Fault+copy bandwidth: back a 2 GiB reservation in 32 MiB pages, copying each
   page from pinned memory as it is faulted, as a ratio to plain
   cuMemcpyHtoDAsync from the same pinned buffer into a cuMemAlloc buffer,
   measured side by side in this run.
2. Map/unmap latency per 32 MiB page: fault (cuMemCreate + cuMemMap +
   cuMemSetAccess) and free (cuMemUnmap + cuMemRelease) per page.
"""

from __future__ import annotations

import json
import sys
import time

from membackend.backends.vmm import VmmBackend
from membackend.drivers.cuda import CudaDriver
from membackend.machine import gather_machine
from membackend.platform import GENERIC
from membackend.session import Session

MiB = 1 << 20
PAGE = 32 * MiB
TOTAL = 2048 * MiB


def main() -> int:
    driver = CudaDriver()
    driver.init()
    driver.set_device(0)
    stream = driver.stream_create()
    pinned = driver.host_alloc_pinned(PAGE)
    plain = driver.mem_alloc(PAGE)
    session = Session(VmmBackend(GENERIC, driver, page_size=PAGE), machine=gather_machine())
    r = session.reserve("cuda:0", TOTAL)
    pages = TOTAL // PAGE

    def plain_copies() -> float:
        start = time.perf_counter()
        for _ in range(pages):
            driver.memcpy_htod_async(plain, pinned, PAGE, stream)
        driver.stream_synchronize(stream)
        return time.perf_counter() - start

    def fault_and_copy() -> tuple[float, float, float]:
        t_fault = 0.0
        start = time.perf_counter()
        for p in range(pages):
            t0 = time.perf_counter()
            assert session.fault(r, p * PAGE, PAGE).ok
            t_fault += time.perf_counter() - t0
            driver.memcpy_htod_async(r.base + p * PAGE, pinned, PAGE, stream)
        driver.stream_synchronize(stream)
        total = time.perf_counter() - start
        t0 = time.perf_counter()
        session.free(r)
        return total, t_fault, time.perf_counter() - t0

    plain_copies()  # warm up both paths
    fault_and_copy()
    best_plain = best_vmm = best_map = best_unmap = float("inf")
    for _ in range(5):
        best_plain = min(best_plain, plain_copies())
        total, t_map, t_unmap = fault_and_copy()
        best_vmm, best_map, best_unmap = min(best_vmm, total), min(best_map, t_map), min(best_unmap, t_unmap)
    session.release_reservation(r)
    driver.mem_free(plain)
    driver.host_free_pinned(pinned)
    figures = {
        "device": driver.name(0),
        "plain_copy_GBps": TOTAL / best_plain / 1e9,
        "fault_copy_GBps": TOTAL / best_vmm / 1e9,
        "fault_copy_ratio": best_plain / best_vmm,
        "map_us_per_page": best_map / pages * 1e6,
        "unmap_us_per_page": best_unmap / pages * 1e6,
    }
    if "--json" in sys.argv:
        print(json.dumps(figures, indent=2))
    else:
        print(f"device: {figures['device']}")
        print(f"fault+copy of 32 MiB pages: {figures['fault_copy_GBps']:.1f} GB/s vs plain pinned copy "
              f"{figures['plain_copy_GBps']:.1f} GB/s  ratio {figures['fault_copy_ratio']:.2f}")
        print(f"map (create+map+access) {figures['map_us_per_page']:.0f} us/page, "
              f"unmap (unmap+release) {figures['unmap_us_per_page']:.0f} us/page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
