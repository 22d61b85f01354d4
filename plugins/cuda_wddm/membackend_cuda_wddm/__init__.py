"""membackend platform plugin ``cuda_wddm``: CUDA on Windows under WDDM, meant for cards with little VRAM.

One :class:`membackend.platform.Platform` record, :data:`PLATFORM`, behind one
entry point in the ``membackend.backends`` group; membackend builds its
virtual-memory backend (named ``cuda_wddm``) from it, over the real
cuda-python driver or, with ``MEMBACKEND_SIM_PROFILE``, its simulated twin.

What it tells the mechanism and the policy, and why:

* **Probe.** Fits when the OS is Windows and every NVIDIA device runs the WDDM
  driver model and supports virtual memory management. Both come from
  machine discovery before torch: ``DeviceInfo.driver_model`` is
  ``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_TCC_DRIVER)`` (0: WDDM; NVML's
  ``nvmlDeviceGetDriverModel`` only where CUDA did not answer), and
  ``DeviceInfo.vmm_supported`` is
  ``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``. TCC and MCDM
  devices (the attribute is 1) are not managed by the WDDM video memory
  manager (no deferred page-in, no sysmem fallback) and DXGI does not report
  their budget; an unknown driver model is not taken for WDDM: score 0, with
  the device named. The score rises as VRAM falls (:func:`score_for`), because
  the smaller the card, the more a load evicts: ComfyUI #16246 is a 6 GB
  RTX 3050 evicting about 20 GB of staged weights to load the next 19 GB.
* **Budget** (``budget_source="wddm"``): DXGI ``QueryVideoMemoryInfo``'s
  budget of the process minus its current usage, minus :func:`headroom`.
  Past the budget a WDDM driver does not fail, it spills to shared system
  memory (ComfyUI PR #11845), so the policy treats the budget as the end.
* **Headroom**: 512 MiB by default, the ``WDDM_BUDGET_HEADROOM`` comfy-aimdo
  keeps on Windows "to avoid deadlocked sysmem fallback" (aimdo
  ``src-win/shmem-detect.c``). The record declares it as its ``headroom``
  setting (:data:`SETTINGS`): ``MEMBACKEND_CUDA_WDDM_HEADROOM``, ``headroom``
  in a ``[cuda_wddm]`` table of ``membackend.toml`` or in
  ``[tool.membackend.cuda_wddm]``, read once when the backend is built. The
  session's own sources win over it: a live change
  (``Session.set_headroom(device, n, source="live")``), ComfyUI's
  ``--reserve-vram``/``--vram-headroom``, the generic ``MEMBACKEND_HEADROOM``.
* **Less churn** (``recycle_handles``, ``recycle_limit=None``): physical
  handles freed by an eviction are kept, with no count limit, and mapped again
  by the next fault instead of released and created again. The budget bounds
  them: a budget query releases kept handles first whenever the driver's free
  memory falls below the headroom, and a trim (unload of everything, close)
  gives them all back.
* **Fence before free** (``fence_granularity="reservation"``): frees and
  releases wait for the events recorded on the reservation (the session's
  fence tokens); the mechanism adds a device synchronize only when pages were
  mapped since the last one, since a fresh mapping may still be paging in and
  no event covers that (the page-in use-after-free of ComfyUI #16246).
* **Pages of 64 MiB**, twice comfy-aimdo's 32 MiB VBAR page: WDDM pages whole
  allocations in, so fewer, larger allocations mean fewer page-ins and
  driver calls.
"""

from __future__ import annotations

import math

from membackend.platform import Platform, PlatformSetting, PlatformValues, size, vmm_unsupported
from membackend.types import Candidate, Capabilities, Machine, Score

__all__ = ["PLATFORM", "NAME", "HEADROOM_ENV", "DEFAULT_HEADROOM", "SETTINGS", "headroom", "probe", "score_for"]

MiB, GiB = 1 << 20, 1 << 30
NAME = "cuda_wddm"
#: the variable of the ``headroom`` setting (membackend reads it: MEMBACKEND_<PLATFORM>_<NAME>)
HEADROOM_ENV = "MEMBACKEND_CUDA_WDDM_HEADROOM"
#: comfy-aimdo's WDDM_BUDGET_HEADROOM (src-win/shmem-detect.c): "to avoid deadlocked sysmem fallback"
DEFAULT_HEADROOM = 512 * MiB
#: the settings this platform declares; membackend reads them under its name and hands them to probe and headroom
SETTINGS = (PlatformSetting("headroom", parse=size, default=DEFAULT_HEADROOM,
                            doc="bytes kept free under the WDDM budget (comfy-aimdo's WDDM_BUDGET_HEADROOM)"),)
#: cards up to about this size are what the plugin is meant for (the score keeps rising below it)
MEANT_FOR = 12 * GiB
SCORE_TOP, SCORE_FLOOR = 90, 60


def score_for(vram: int) -> int:
    """The probe's score for the smallest WDDM device: ``96 - 2 per GiB of VRAM`` (rounded up),
    kept within 60-90 of the platform band: 4 GB 88, 6 GB 84, 8 GB 80, 12 GB 72, 18 GB and up 60.
    Unknown VRAM (0) scores as a large card."""
    if vram <= 0:
        return SCORE_FLOOR
    return max(SCORE_FLOOR, min(SCORE_TOP, 96 - 2 * math.ceil(vram / GiB)))


def headroom(total: int = 0, settings: PlatformValues | None = None) -> int:
    """Bytes kept free under a WDDM budget of ``total`` bytes: the ``headroom`` setting (``settings``,
    the values membackend read; None: the default, :data:`DEFAULT_HEADROOM`).

    A headroom as large as a device is refused by :func:`probe` (score 0, naming the key), so this never
    raises; one as large as the budget leaves no usable bytes, which the budget then says. Reads no
    environment: a change while running goes through the session (``Session.set_headroom(device, n,
    source="live")``).
    """
    return DEFAULT_HEADROOM if settings is None else settings["headroom"]


def probe(machine: Machine, settings: PlatformValues | None = None) -> Candidate:
    """Windows, and every NVIDIA device under WDDM (TCC_DRIVER = 0) with virtual memory management
    support; the score rises as VRAM falls (:func:`score_for`). The reason names the headroom
    (``settings``: the platform's values; None: the default).

    Pure: reads machine facts only, no GPU context. (A headroom setting that
    cannot be parsed never gets here: membackend refuses it when it reads the
    settings, and lists the plugin as broken with the reason.) A headroom as
    large as the smallest device scores 0 with the key and its source named, so
    selection goes on with another backend.
    """
    if machine.os != "windows":
        return Candidate(NAME, Score.NONE, f"the OS is {machine.os}, not Windows: WDDM is Windows' display driver "
                                           "model")
    gpus = machine.gpus("cuda")
    if not gpus:
        return Candidate(NAME, Score.NONE, "no NVIDIA (CUDA) device found")
    others = [d for d in gpus if d.driver_model != "wddm"]
    if others:
        named = ", ".join(f"{d.device} ({d.name or 'unnamed'}): "
                          f"{d.driver_model.upper() if d.driver_model else 'driver model unknown'}" for d in others)
        return Candidate(NAME, Score.NONE,
                         f"not every NVIDIA device runs under WDDM ({named}); TCC and MCDM devices have no WDDM "
                         "page-in or sysmem fallback and no DXGI budget: the generic vmm backend serves them "
                         f"(force this one with MEMBACKEND_BACKEND={NAME} if the driver model is misreported)")
    lacking = vmm_unsupported(gpus)
    if lacking:
        return Candidate(NAME, Score.NONE, lacking)
    smallest = min(gpus, key=lambda d: d.total_memory or math.inf)
    score = score_for(smallest.total_memory)
    vram = f"{smallest.total_memory / GiB:.1f} GiB" if smallest.total_memory else "unknown VRAM"
    fit = "a small card, what this plugin is meant for" if 0 < smallest.total_memory <= MEANT_FOR \
        else "more than the ~12 GB this plugin is meant for, so it scores low in the band"
    room = DEFAULT_HEADROOM if settings is None else settings["headroom"]
    if smallest.total_memory and room >= smallest.total_memory:
        source = "default" if settings is None else settings.source("headroom")
        return Candidate(NAME, Score.NONE, f"{NAME}.headroom ({source}) is {room} bytes, which would leave nothing "
                                           f"of {smallest.device}'s {smallest.total_memory} bytes; accepted: a size "
                                           f"below {smallest.total_memory} bytes")
    return Candidate(NAME, score,
                     f"Windows, {len(gpus)} NVIDIA device(s) under WDDM (from "
                     f"{smallest.source_of('driver_model') or smallest.source or 'the machine facts'}); smallest "
                     f"{smallest.device} "
                     f"({smallest.name or 'unnamed'}) has {vram}, {fit}; score = 96 - 2 per GiB of VRAM, "
                     f"within {SCORE_FLOOR}-{SCORE_TOP}; budget = DXGI budget - usage - {room // MiB} MiB headroom")


#: the platform record (entry point ``cuda_wddm = "membackend_cuda_wddm:PLATFORM"``)
PLATFORM = Platform(
    name=NAME,
    vendor="cuda",
    probe=probe,
    budget_source="wddm",
    capabilities=Capabilities(recycle_handles=True, recycle_limit=None, fence_granularity="reservation",
                              release_on_full_unload=True,
                              # VidMm pages a fresh mapping in after cuMemMap returns, and no fence token covers
                              # that: a free after a fault synchronizes the device first (ComfyUI #16246)
                              page_in_sync="always"),
    page_size=64 * MiB,
    headroom=headroom,
    settings=SETTINGS,
    description="CUDA on Windows WDDM with little VRAM: DXGI budget, recycled handles, event fences before frees",
    version="0.1.0",
)
