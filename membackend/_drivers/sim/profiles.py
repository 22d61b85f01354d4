"""Platform profiles for the simulated drivers: small data records, selectable by name.

Each number is the public figure of the platform it models (each profile's
``notes`` name the public report it comes from); behaviours are switched on
per profile and implemented in ``platform.py``, which names the source of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..._settings.rules import did_you_mean, quoted
from ...types import Capabilities, ConfigError

__all__ = ["SimDeviceSpec", "Profile", "PROFILES", "get_profile", "ROCM_7_14"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: HIP_VERSION of ROCm 7.14.0 (major x 10,000,000 + minor x 100,000 + patch): from this runtime on, Linux holds
#: one dmabuf file descriptor per live hipMemCreate handle (ROCm/rocm-systems #10604; ROCm 7.1.1 held 3 in all,
#: ROCm/legacy-rocm-build #6661)
ROCM_7_14 = 71_400_000


@dataclass(frozen=True)
class SimDeviceSpec:
    """One simulated device: what its driver answers to discovery (name, memory, attributes)."""

    name: str
    vram: int
    arch: str
    integrated: bool = False
    vmm: bool = True  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED / hipDeviceAttribute...


@dataclass(frozen=True)
class Profile:
    """One simulated machine.

    ``vendor`` picks the API surface (``cuda``: cuda-python names; ``hip``:
    hip-python names). ``os``, ``host_ram`` and ``torch`` describe the
    simulated host the discovery code reads besides the driver (the OS name,
    ``/proc/meminfo``, torch's installed version). The flags switch documented
    platform behaviours on.
    """

    name: str
    vendor: str
    os: str
    devices: tuple[SimDeviceSpec, ...]
    host_ram: int
    description: str
    torch: str = ""  # the torch build the simulated host has installed ("" : none)
    driver_version: int = 12080  # cuDriverGetVersion / hipDriverGetVersion's answer
    granularity: int = 2 * MiB
    copy_bandwidth: float = 25e9  # bytes/s of an async host-to-device copy (PCIe 4.0 x16 class)
    # Windows WDDM: a created+mapped handle pages in later; unmapping or releasing it
    # (or memory a copy still reads) before that completes is a kernel use-after-free.
    wddm: bool = False
    pagein_seconds: float = 0.0
    wddm_budget_headroom: int = 0  # DXGI budget = VRAM minus this (the OS keeps the rest)
    # Unified memory: GPU pages, host copies and pinned memory draw from one pool.
    unified: bool = False
    page_cache: int = 0  # counted in MemAvailable, not in MemFree
    # Windows ROCm: reserved address space is charged to private commit, a per-process GPU
    # address quota covers reservations and mappings, large windows wear out with churn.
    private_commit_reservations: bool = False
    address_quota: int | None = None
    churn_limit: int | None = None
    churn_window: int = 1 * GiB
    current_device_checked: bool = False
    # Linux CUDA: cuMemUnmap "exhibits synchronous behavior for most use cases" (CUDA driver
    # API docs, cuMemUnmap), so pending work on the range finishes first instead of racing.
    unmap_synchronizes: bool = False
    # AMD on Linux (membackend issue 27's public reports): an APU's BIOS carve-out (sysfs VRAM) and GTT; HIP's
    # free answered from the host's MemFree, above its own total (Strix Halo); ROCm 7.2 returning a released
    # handle's memory only when its address range is freed; RDNA4 kernels faulting on mappings aligned below
    # this many bytes although the runtime reports 4 KiB granularity
    carveout: int = 0
    gtt: int = 0
    hip_free_is_host_free: bool = False
    memory_held_until_address_free: bool = False
    map_fault_below: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def descriptor_per_handle(self) -> bool:
        """Whether each live physical handle holds one of the process's file descriptors: HIP on Linux from
        ROCm 7.14 on (:data:`ROCM_7_14`; ``simulated_driver(profile, driver_version=ROCM_7_14)`` selects it on
        a ROCm 7.2 profile). The simulation counts them against the process's ``RLIMIT_NOFILE``."""
        return self.vendor == "hip" and self.os == "linux" and self.driver_version >= ROCM_7_14

    def capabilities(self) -> Capabilities:
        """What this profile's platform would tell the policy, for tests and benchmarks that run the
        generic backend with a platform's knobs on a simulated machine (the platform plugins carry
        their own records; this is the simulation's summary of the flags above)."""
        quota = self.address_quota
        return Capabilities(
            unified_pool=self.unified,
            address_quota=quota - quota // 16 if quota else None,  # keep a margin below the crash point
            reserve_churn_limit=self.churn_limit,
            reserve_churn_window=self.churn_window,
            fence_granularity="device" if self.wddm else "reservation",
            # the profile's own OS, not this process's: its Windows platforms synchronize after fresh mappings
            page_in_sync="always" if self.os == "windows" else "never",
            memory_returns_on_unmap=not self.memory_held_until_address_free,
            map_granularity=self.map_fault_below or None,
            handle_descriptors=self.descriptor_per_handle,
        )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="wddm-6gb", vendor="cuda", os="windows",
            devices=(SimDeviceSpec("NVIDIA GeForce RTX 3050", 6 * GiB, "sm_86"),),
            host_ram=32 * GiB,
            description="Windows CUDA under WDDM, 6 GB (RTX 3050 class): deferred page-in, sysmem fallback",
            torch="2.13.0+cu128", driver_version=12080,
            wddm=True, pagein_seconds=0.004, wddm_budget_headroom=512 * MiB,
            notes=("ComfyUI #16246: allocate/free churn during page-in ends in a bugcheck",
                   "ComfyUI PR #11845: past the budget the driver spills to shared memory"),
        ),
        Profile(
            name="rocm-win-2gpu", vendor="hip", os="windows",
            devices=(SimDeviceSpec("AMD Radeon RX 9070 XT", 16 * GiB, "gfx1201"),
                     SimDeviceSpec("AMD Radeon RX 9070 XT", 16 * GiB, "gfx1201")),
            host_ram=64 * GiB,
            description="Windows ROCm, 2 x 16 GB (gfx1201): commit-charged reservations, 256 GiB quota, churn defect",
            torch="2.13.0+rocm10.0.0", driver_version=100000000,  # HIP_VERSION encoding: 10.0.0
            private_commit_reservations=True, address_quota=256 * GiB, churn_limit=14, current_device_checked=True,
            notes=("ComfyUI #15993: 41.58 GB private bytes stay committed after unload",
                   "rocm-systems #9823: the 16th 16 GiB window (240 GiB) crashed",
                   "rocm-systems #6191: reserve fails after ~14 reserve/free cycles",
                   "TheRock #6224: the free path breaks with a second device visible"),
        ),
        Profile(
            name="gb10-128gb", vendor="cuda", os="linux",
            devices=(SimDeviceSpec("NVIDIA GB10", 128 * 10**9, "sm_121", integrated=True),),
            host_ram=128 * 10**9,
            description="GB10 unified memory, 128 GB shared by CPU and GPU; MemFree below MemAvailable",
            torch="2.13.0+cu130", driver_version=13000,
            unified=True, page_cache=12 * GiB, copy_bandwidth=200e9, unmap_synchronizes=True,
            notes=("ComfyUI #15285: free memory must come from MemAvailable on one pool",
                   "unsloth PR #11208: 8,128 MiB reported vs 46,477 MiB real"),
        ),
        Profile(
            name="jetson-orin-16gb", vendor="cuda", os="linux",
            devices=(SimDeviceSpec("Orin", 16 * GiB, "sm_87", integrated=True),),
            host_ram=16 * GiB,
            description="Jetson Orin NX class, 16 GB shared by CPU and GPU, CUDA 12 (JetPack 6)",
            torch="2.5.0a0+872d972e41.nv24.08", driver_version=12060,
            unified=True, page_cache=1 * GiB, copy_bandwidth=50e9, unmap_synchronizes=True,
            notes=("CUDA for Tegra app note, Memory Management: CPU and iGPU share the system DRAM; "
                   "the allocatable device memory is estimated from the host's available memory",
                   "JetPack 6 ships CUDA 12 (driver 12.6 here); the device is sm_87 (Ampere, T234)"),
        ),
        Profile(
            name="h200", vendor="cuda", os="linux",
            devices=(SimDeviceSpec("NVIDIA H200", 143_771 * MiB, "sm_90"),),
            host_ram=256 * GiB,
            description="discrete CUDA on Linux, 141 GB (the control)",
            torch="2.13.0+cu130", driver_version=13000,
            unmap_synchronizes=True,
        ),
        Profile(
            name="rtx4090-2gpu", vendor="cuda", os="linux",
            # two discrete cards in one box: nvidia-smi's 24564MiB per GeForce RTX 4090 (24 GB GDDR6X, AD102)
            devices=(SimDeviceSpec("NVIDIA GeForce RTX 4090", 24_564 * MiB, "sm_89"),
                     SimDeviceSpec("NVIDIA GeForce RTX 4090", 24_564 * MiB, "sm_89")),
            host_ram=128 * GiB,
            description="two discrete CUDA GPUs on Linux, 24 GB each: each thread has its own current device "
                        "(a call on a range must book to the GPU that owns it, comfy-aimdo #99)",
            torch="2.13.0+cu130", driver_version=13000,
            unmap_synchronizes=True,
        ),
        Profile(
            name="strix-halo-128gb", vendor="hip", os="linux",
            devices=(SimDeviceSpec("AMD Radeon 8060S Graphics", 96 * GiB, "gfx1151", integrated=True),),
            host_ram=128 * GiB - 512 * MiB,  # MemTotal: the BIOS carve-out is not the kernel's
            description="Strix Halo APU (gfx1151), 128 GB in one pool: 512 MiB carve-out, 96 GiB GTT; "
                        "hipMemGetInfo's free above its total",
            torch="2.13.0+rocm7.2", driver_version=70200000,  # HIP_VERSION encoding: 7.2.0
            granularity=4 * KiB, unified=True, page_cache=6 * GiB, copy_bandwidth=120e9,
            carveout=512 * MiB, gtt=96 * GiB, hip_free_is_host_free=True, memory_held_until_address_free=True,
            notes=("one pool, 'mapped, not physically partitioned': the carve-out is sysfs mem_info_vram_total, "
                   "the rest GTT (mem_info_gtt_total = ttm.pages_limit x 4096)",
                   "hipMemGetInfo reported free 120.00 GiB above total 62.47 GiB on one HIP version",
                   "ROCm 7.2: physical memory returns only when the address range is freed (vLLM)"),
        ),
        Profile(
            name="rx7900xtx-linux", vendor="hip", os="linux",
            devices=(SimDeviceSpec("AMD Radeon RX 7900 XTX", 24 * GiB, "gfx1100"),),
            host_ram=64 * GiB,
            description="discrete RDNA3 on Linux ROCm 7.2, 24 GB (the second-run-slower reports)",
            torch="2.13.0+rocm7.2", driver_version=70200000,
            granularity=4 * KiB, memory_held_until_address_free=True,
            notes=("an RX 7900 XT report: a second run 234 s with dynamic VRAM against 22 s without",
                   "ROCm on Linux answers 4 KiB minimum granularity (ROCm/rocm-systems PR #1176)",
                   "ROCm 7.2: physical memory returns only when the address range is freed (vLLM)"),
        ),
        Profile(
            name="rx9070xt-linux", vendor="hip", os="linux",
            devices=(SimDeviceSpec("AMD Radeon RX 9070 XT", 16 * GiB, "gfx1201"),),
            host_ram=64 * GiB,
            description="discrete RDNA4 on Linux ROCm 7.2, 16 GB: 4 KiB granularity reported, 2 MiB needed",
            torch="2.13.0+rocm7.2", driver_version=70200000,
            granularity=4 * KiB, map_fault_below=2 * MiB, memory_held_until_address_free=True,
            notes=("RDNA4 (gfx1201): the runtime reports 4 KiB VMM granularity, kernels fault on 4 KiB-aligned "
                   "mappings: map in 2 MiB or more",
                   "ROCm 7.2: physical memory returns only when the address range is freed (vLLM)"),
        ),
        Profile(
            name="gfx1150-apu", vendor="hip", os="linux",
            devices=(SimDeviceSpec("AMD Radeon 890M Graphics", 2 * GiB, "gfx1150", integrated=True, vmm=False),),
            host_ram=32 * GiB - 2 * GiB,
            description="Strix Point APU (gfx1150): no VMM, hipMalloc limited to the 2 GiB carve-out",
            torch="2.13.0+rocm7.2", driver_version=70200000,
            granularity=4 * KiB, unified=True, page_cache=2 * GiB, carveout=2 * GiB, gtt=15 * GiB,
            notes=("Strix Point (gfx1150): hipMemCreate is not supported; hipMalloc is limited to the carve-out",),
        ),
        Profile(
            name="mi100-novmm", vendor="hip", os="linux",
            devices=(SimDeviceSpec("AMD Instinct MI100", 32 * GiB, "gfx908", vmm=False),),
            host_ram=256 * GiB,
            description="HIP on Linux without virtual memory management (MI100 under ROCm 5.4): no VMM backend fits",
            torch="2.0.1+rocm5.4.2", driver_version=50422804,
            notes=("ROCm/hip #3151: hipDeviceAttributeVirtualMemoryManagementSupported is 0 on MI100, ROCm 5.4.2",
                   "a device without it fails hipMemCreate / cuMemCreate with ...NotSupported"),
        ),
    )
}


def get_profile(name: str, source: str = "settings") -> Profile:
    """The profile called ``name``; ``ConfigError`` (key ``sim_profile``, from ``source``) for a name none
    has, quoting it cut short, with the closest name and every profile's (from :data:`PROFILES` itself):
    the one refusal of an unknown profile, wherever the name is checked."""
    try:
        return PROFILES[name]
    except (KeyError, TypeError):  # TypeError: a name that is no key at all (a list)
        raise ConfigError("sim_profile", source,
                          f"unknown simulation profile {quoted(name)}{did_you_mean(name, PROFILES)}",
                          ", ".join(PROFILES)) from None
