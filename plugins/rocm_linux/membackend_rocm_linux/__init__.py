"""membackend platform ``rocm_linux``: AMD GPUs on Linux, discrete cards and APUs sharing one memory pool.

One :class:`membackend.platform.Platform` record, published as the entry point
``rocm_linux = "membackend_rocm_linux:PLATFORM"``. membackend builds its
virtual-memory backend from it (the mechanism stays ``vmm``'s); this module
says when it fits and how the mechanism and the policy must treat the
platform. Each rule comes from a public report (membackend issue 27):

* **When it fits** (:func:`probe`): Linux, torch a ROCm build or absent, and
  HIP devices listed by machine discovery (hip-python or the HIP runtime
  through ctypes), every one an AMD ``gfx`` device that reports
  ``hipDeviceAttributeVirtualMemoryManagementSupported``. A part without it
  (Strix Point, gfx1150: ``hipMemCreate`` is not supported and ``hipMalloc``
  is limited to the carve-out) is not claimed, and the reason says so. ROCm on
  Windows is ``rocm_windows``'s; CUDA devices are never this platform's.
* **VMM proven at start-up** (``vmm_self_test``): the attribute is read by
  the probe, and on each device's first use the mechanism reserves, creates,
  maps, sets access to, unmaps, releases and frees one page; a failed step
  refuses the device (VMM on Strix Halo under WSL failed until a ROCm fix).
* **Pages of at least 2 MiB** (``map_granularity``): RDNA4 (gfx1201) reports
  4 KiB granularity, but kernels fault on 4 KiB-aligned mappings. Pages are
  :data:`PAGE_SIZE` (comfy-aimdo's 32 MiB VBAR page) and never below
  :data:`MIN_MAP` whatever page size is asked for; reservations are aligned
  to the page.
* **No aliasing** (``recycle_handles=False``): on RDNA two addresses mapping
  one physical allocation see incoherent caches. A physical handle is mapped
  at one address at a time, and a kept handle is mapped again only after its
  unmap.
* **Release that really releases** (``memory_returns_on_unmap=False``): ROCm
  7.2 returns physical memory only when the address range is freed, not on
  unmap alone (vLLM frees and re-reserves the range). A page freed under
  pressure keeps its handle with its own reservation, for that reservation's
  next fault; a full unload releases the reservation (``release_on_full_unload``)
  and a whole model evicted by the residency manager is evicted by releasing
  its reservation, the frees that return memory.
* **Budgets** (``budget_source="auto"``): a discrete card's from
  ``hipMemGetInfo``; an APU's (an integrated device) from its one pool, the
  smallest of ``hipMemGetInfo``'s free never above its own total, what sysfs's
  carve-out and GTT leave, and the host's ``MemAvailable`` less a reserve for
  the system (:mod:`membackend._drivers.apu`; ``membackend doctor`` and the
  memory panel show all three and the one that bound). A discrete card's
  budget is what it is: with offload a smaller budget can be slower than a
  larger one, so its source matters as much as its size.
* **One pool on an APU**: membackend's one-pool rules, shared with
  ``unified_gb10`` (``membackend.platform.ONE_POOL``): a fault past the pool is
  refused before the driver is asked, models are kept warm across workflow
  switches while the pool allows, no pinned host copies of weights (the
  ComfyUI adapter turns ComfyUI's pinning off when a budget says one pool), and
  the headroom is the pool's (:func:`headroom`: an eighth within 1-16 GiB;
  :data:`DISCRETE_HEADROOM` on a discrete card).
* **Linux**: no video memory manager pages mappings in, so frees wait for the
  recorded fence tokens only (``page_in_sync="never"``).
* **A descriptor per handle** (``handle_descriptors``): ROCm 7.14 holds one
  dmabuf file descriptor of the process per live ``hipMemCreate`` handle
  (ROCm/rocm-systems #10604; ROCm 7.1.1 kept 3 in all, ROCm/legacy-rocm-build
  #6661), so under ``ulimit -n 1024`` a process stops at about 1,015 handles,
  31.7 GiB of 32 MiB pages, with ``hipErrorOutOfMemory``. On its first use of
  a device the mechanism raises the soft ``RLIMIT_NOFILE`` toward the hard
  limit, as far as one descriptor per page of every device's memory needs
  (3,072 on a 96 GiB device, plus a margin; never lowered), and ``membackend
  doctor`` says what it did and, when the limit still bounds a device below
  its budget, what it can map. The handles stay bounded: 32 MiB pages, each
  handle reused by its own range (above) or released. A create refused for
  want of a descriptor raises ``DescriptorLimit`` (a ``DriverError``) naming
  the limit, the figure reached and ``ulimit -n``: never out of memory, which
  would send the residency manager to evict models for nothing. Every ROCm
  version gets it: on one that keeps a few descriptors the raise costs nothing.

**Settings.** ``PLATFORM`` declares one setting, ``headroom`` (a size:
``MEMBACKEND_ROCM_LINUX_HEADROOM``, or ``headroom`` in a ``[rocm_linux]``
table), which replaces the rule on every device; the session's own sources
(a live change, ComfyUI's ``--reserve-vram``, ``MEMBACKEND_HEADROOM``) win
over it. Importing this module never fails and reads no environment.
"""

from __future__ import annotations

from membackend.platform import (
    ONE_POOL,
    Platform,
    PlatformSetting,
    PlatformValues,
    amd_unfit,
    one_pool_headroom,
    size,
    vmm_unsupported,
)
from membackend.types import Candidate, Capabilities, DeviceInfo, Machine, Score

__all__ = ["PLATFORM", "SETTINGS", "NAME", "PAGE_SIZE", "MIN_MAP", "DISCRETE_HEADROOM", "SCORE_TORCH",
           "SCORE_LISTED", "CAPABILITIES", "probe", "headroom"]
__version__ = "0.1.0"

MiB, GiB = 1 << 20, 1 << 30
NAME = "rocm_linux"
PAGE_SIZE = 32 * MiB  # comfy-aimdo's VBAR page
MIN_MAP = 2 * MiB  # RDNA4 reports 4 KiB granularity; kernels fault on mappings aligned below 2 MiB
DISCRETE_HEADROOM = 512 * MiB  # kept free on a discrete card for activations (comfy-aimdo keeps 256 MiB)
SCORE_TORCH = 70  # Linux, a ROCm build of torch, AMD devices listed
SCORE_LISTED = 60  # Linux, AMD devices listed by discovery, no torch

#: what the platform tells the mechanism and the policy (see the module docstring)
CAPABILITIES = Capabilities(
    release_on_full_unload=ONE_POOL.release_on_full_unload,  # G1; and the free that really returns (ROCm 7.2)
    recycle_handles=ONE_POOL.recycle_handles,  # no handle kept device-wide: no aliasing, nothing held from a pool
    fence_granularity=ONE_POOL.fence_granularity,
    page_in_sync=ONE_POOL.page_in_sync,  # Linux: no video memory manager pages mappings in
    memory_returns_on_unmap=False,  # ROCm 7.2: only freeing the range returns its memory
    map_granularity=MIN_MAP,
    vmm_self_test=True,
    handle_descriptors=True,  # ROCm 7.14: one dmabuf descriptor per live handle (ROCm/rocm-systems #10604)
)


def headroom(total: int, settings: PlatformValues | None = None, integrated: bool = False) -> int:
    """Bytes kept free on a device of ``total`` bytes: the ``headroom`` setting when set, else the one-pool
    rule on an APU (``integrated``: an eighth of the pool within 1-16 GiB, shared with ``unified_gb10``) and
    :data:`DISCRETE_HEADROOM` on a discrete card (never more than half the device)."""
    wanted = None if settings is None else settings["headroom"]
    if wanted is not None:
        return wanted
    return one_pool_headroom(total) if integrated else min(DISCRETE_HEADROOM, total // 2)


#: the settings this platform declares (membackend reads them under its name and hands them to headroom)
SETTINGS = (PlatformSetting("headroom", parse=size, default=None,
                            doc="bytes kept free on every device, replacing the rule (an eighth of an APU's "
                                "pool within 1-16 GiB; 512 MiB on a discrete card)"),)


def _described(d: DeviceInfo) -> str:
    kind = "APU, one pool with the host" if d.integrated else "discrete"
    return f"{d.device} {d.name or 'unnamed'} ({d.arch or 'architecture unknown'}, {kind})"


def probe(machine: Machine, settings: PlatformValues | None = None) -> Candidate:
    """Linux, a ROCm (or no) torch build, and AMD (``gfx``) HIP devices listed, each supporting virtual
    memory management; 0 with the reason elsewhere. Pure: reads the machine facts only (no GPU context);
    the VMM self-test runs when the backend first uses a device."""
    if machine.os != "linux":
        other = "; ROCm on Windows is served by rocm_windows" if machine.os == "windows" else ""
        return Candidate(NAME, Score.NONE, f"not Linux (this machine runs {machine.os}){other}")
    unfit = amd_unfit(machine, NAME, "the amdgpu driver, /dev/kfd access and HIP_VISIBLE_DEVICES")
    if unfit is not None:
        return unfit
    gpus = machine.gpus("hip")
    lacking = vmm_unsupported(gpus)
    if lacking:
        apus = [d for d in gpus if d.integrated and d.vmm_supported is False]
        why = (f"{apus[0].device} {apus[0].name or ''} ({apus[0].arch or '?'}) is an APU without virtual memory "
               "management (gfx1150-class: hipMemCreate is not supported, hipMalloc is limited to the carve-out), "
               "so rocm_linux does not claim it: " if apus else "")
        return Candidate(NAME, Score.NONE, why + lacking)
    listed = ", ".join(_described(d) for d in gpus)
    if machine.torch_vendor == "rocm":
        score, via = SCORE_TORCH, "a ROCm build of torch"
    else:
        score, via = SCORE_LISTED, f"no torch; HIP devices listed by {gpus[0].source or 'the machine facts'}"
    apu = any(d.integrated for d in gpus)
    budget = ("budgets: an APU's the smallest of hipMemGetInfo (never above its total), sysfs carve-out + GTT "
              "and MemAvailable less a system reserve" if apu else "budgets from hipMemGetInfo")
    return Candidate(NAME, score, f"Linux ROCm on {len(gpus)} device(s): {listed}; {via}; pages of "
                                  f"{PAGE_SIZE // MiB} MiB (never below {MIN_MAP // MiB} MiB), no aliasing, "
                                  f"reservations freed to release their memory (ROCm 7.2); {budget}")


#: the platform record (entry point ``rocm_linux = "membackend_rocm_linux:PLATFORM"``)
PLATFORM = Platform(
    name=NAME,
    vendor="hip",
    probe=probe,
    budget_source="auto",  # an APU's one pool (three figures, the smallest), a discrete card's hipMemGetInfo
    capabilities=CAPABILITIES,
    page_size=PAGE_SIZE,
    headroom=headroom,
    settings=SETTINGS,
    description="AMD GPUs on Linux, discrete and APUs: VMM proven at start-up, pages of at least 2 MiB, no "
                "aliasing, reservations freed to release memory, an APU's budget from one pool",
    version=__version__,
)
