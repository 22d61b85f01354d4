"""ROCm 7.14's one file descriptor per hipMemCreate handle (issue 43, item 1), measured under this process's real
descriptor limit: the bytes a 96 GiB device (the Strix Halo profile, a ROCm 7.14 runtime) maps before a fault is
refused, without the descriptor part (the generic mechanism, as every backend was before) and with the rocm_linux
plugin, which raises the soft ``RLIMIT_NOFILE`` at start-up.

Run it under the report's limit, in a shell of its own (the plugin raises the process's soft limit)::

    bash -c 'ulimit -Sn 1024; .venv/bin/python benchmarks/bench_descriptors.py'

With ``ulimit -n 1024`` (hard and soft), the plugin cannot raise the limit and its fault is ``DescriptorLimit`` (the typed
error that names the limit and the fix), never an out-of-memory answer. Simulated: the device's bytes are books
only (``hold_bytes=False``), the descriptors are counted, not opened.
"""

from __future__ import annotations

import dataclasses
import resource

from membackend.lab.simulated import simulated_driver, simulated_session
from membackend.types import DescriptorLimit
from membackend_rocm_linux import PLATFORM

GiB, MiB = 1 << 30, 1 << 20
PROFILE, DEV, PAGE = "strix-halo-128gb", "hip:0", 32 * MiB
ROCM_7_14 = 71_400_000  # HIP_VERSION of ROCm 7.14.0: the runtime that holds one descriptor per handle


def mapped_until_refused(platform, capabilities=None) -> tuple[int, str]:
    """Fault a 90 GiB range a page at a time until a fault is refused; the bytes mapped and how it ended."""
    driver = simulated_driver(PROFILE, hold_bytes=False, driver_version=ROCM_7_14)
    s = simulated_session(PROFILE, platform, driver=driver, capabilities=capabilities, page_size=PAGE)
    try:
        r = s.reserve(DEV, 90 * GiB)
        mapped = 0
        for offset in range(0, r.size, PAGE):
            try:
                f = s.fault(r, offset, PAGE)
            except DescriptorLimit as exc:
                return mapped, f"DescriptorLimit: {exc}"
            if not f.ok:
                return mapped, "out of memory"
            mapped += f.mapped
        return mapped, "no refusal"
    finally:
        s.close()


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"RLIMIT_NOFILE at start: soft {soft}, hard {hard}; {PROFILE} ({DEV}), ROCm 7.14, {PAGE // MiB} MiB pages")
    caps = dataclasses.replace(PLATFORM.capabilities, handle_descriptors=False)
    before, how = mapped_until_refused(None, caps)
    print(f"before (no descriptor part): {before / GiB:.1f} GiB mapped ({before // PAGE:,} handles), then {how}")
    after, how = mapped_until_refused(PLATFORM)
    soft_now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(f"after (rocm_linux, soft limit now {soft_now}): {after / GiB:.1f} GiB mapped ({after // PAGE:,} "
          f"handles), then {how}")


if __name__ == "__main__":
    main()
