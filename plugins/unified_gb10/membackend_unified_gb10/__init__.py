"""membackend platform ``unified_gb10``: integrated CUDA devices that share one memory pool with the host.

On a GB10 (DGX Spark), a Jetson or any other integrated NVIDIA part there is
no VRAM of its own: device pages, pinned host buffers, staging copies and the
rest of the system all draw from one pool of system memory. This record tells
membackend's generic virtual-memory backend so (it subclasses nothing; the
mechanism stays that backend's, ``vmm``):

* **When it fits** (:func:`probe`): every CUDA device of the machine reports
  the *integrated* attribute and supports virtual memory management, as
  machine discovery reads them before torch
  (``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_INTEGRATED)`` and
  ``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``; NVML says
  nothing of it and its memory query is unsupported on GB10). Unified
  addressing alone never decides it: every discrete GPU on 64-bit Linux has
  unified addressing too. A machine that mixes integrated and discrete CUDA
  devices is left to the generic ``vmm`` backend, since one budget source
  cannot describe both. The score is :data:`SCORE`, in the platform band,
  above the generic backends.
* **One pool (G3)**: the budget source is ``unified`` — ``MemAvailable``
  (which counts reclaimable page cache) capped by the memory cgroup — never
  the driver's mem-get-info, which reports ``MemFree`` on these parts
  (ComfyUI #15285; NVML memory queries are unsupported on GB10). Device pages
  and pinned host memory lower ``MemAvailable`` alike, so both count.
* **Refused up front**: ``Capabilities(unified_pool=True)``: a fault that
  would take the pool below the headroom is out of memory (``Fault(ok=False)``)
  before the driver is asked, and the residency manager evicts whole models,
  least recently used first, and retries. Without it a GB10 driver refuses late
  with ``NV_ERR_NO_MEMORY`` and the loader aborts (ComfyUI #15285: 4 SIGABRTs
  loading a 39 GB UNet at about 95 of 121 GiB).
* **Keep warm (G4)**: nothing here evicts on a workflow switch; the residency
  manager keeps every model resident while this budget allows (ComfyUI #14519:
  image → video → image went back from about 9 s to about 120 s).
* **Headroom** (:func:`headroom`): :data:`HEADROOM_FRACTION` of the pool,
  within :data:`HEADROOM_MIN` and :data:`HEADROOM_MAX` (16 GiB on a 128 GB
  GB10 is what a GB10 user in ComfyUI #15285 needed as ``--reserve-vram 16``).
  The record declares a ``headroom`` setting (:data:`SETTINGS`; a size:
  ``12GiB``, ``8000MB``) that replaces the rule:
  ``MEMBACKEND_UNIFIED_GB10_HEADROOM``, ``headroom`` in a ``[unified_gb10]``
  table of ``membackend.toml`` or in ``[tool.membackend.unified_gb10]``, read
  once when the backend is built. The session's own sources win over both: a
  live change (``Session.set_headroom(device, n, source="live")``, the memory
  panel's), ComfyUI's ``--reserve-vram``/``--vram-headroom``, the generic
  ``MEMBACKEND_HEADROOM``.
* **Pages** of :data:`PAGE_SIZE` (comfy-aimdo's 32 MiB VBAR page): a 45 GB
  model is about 1,300 maps instead of about 21,000 at the 2 MiB granularity.
  Freed physical memory is released, not kept for reuse: on one pool a kept
  handle is memory the host cannot have.
"""

from __future__ import annotations

from membackend.platform import (
    ONE_POOL,
    ONE_POOL_HEADROOM_FRACTION,
    ONE_POOL_HEADROOM_MAX,
    ONE_POOL_HEADROOM_MIN,
    Platform,
    PlatformSetting,
    PlatformValues,
    one_pool_headroom,
    size,
    vmm_unsupported,
)
from membackend.types import Candidate, Machine, Score, format_size

__all__ = ["PLATFORM", "probe", "headroom", "HEADROOM_ENV", "HEADROOM_FRACTION", "HEADROOM_MIN", "HEADROOM_MAX",
           "SCORE", "PAGE_SIZE", "SETTINGS"]

__version__ = "0.1.0"

MiB, GiB = 1 << 20, 1 << 30

#: probe score when it fits: platform band, above the generic backends (vmm 20, aimdo 10)
SCORE = 70
#: the environment variable of the ``headroom`` setting, which replaces the default rule
HEADROOM_ENV = "MEMBACKEND_UNIFIED_GB10_HEADROOM"
#: default headroom: this fraction of the pool, clamped to [HEADROOM_MIN, HEADROOM_MAX] (membackend's one-pool
#: rule, shared with every platform of one pool: ``membackend.platform.one_pool_headroom``)
HEADROOM_FRACTION = ONE_POOL_HEADROOM_FRACTION
HEADROOM_MIN = ONE_POOL_HEADROOM_MIN  # what the OS and the process's own activations need on a small Jetson
HEADROOM_MAX = ONE_POOL_HEADROOM_MAX  # ComfyUI #15285: a GB10 (121 GiB) user ran stably with --reserve-vram 16
PAGE_SIZE = 32 * MiB  # comfy-aimdo's VBAR page: fewer map calls per multi-GB model


def _gb(n: int) -> str:
    return format_size(n)  # as membackend writes every size


def headroom(total: int, settings: PlatformValues | None = None) -> int:
    """Bytes kept free of a pool of ``total`` bytes.

    The ``headroom`` setting when set (``settings``, the values membackend
    read; it must be smaller than the pool), else ``total * HEADROOM_FRACTION``
    clamped to ``[HEADROOM_MIN, HEADROOM_MAX]`` (and never more than half the
    pool). A setting as large as the pool is refused by :func:`probe` (score 0,
    naming the key), so this never raises. Reads no environment.
    """
    wanted = None if settings is None else settings["headroom"]
    if wanted is not None:
        return wanted
    return one_pool_headroom(total)


#: the settings this platform declares (membackend reads them under its name and hands them to headroom)
SETTINGS = (PlatformSetting("headroom", parse=size, default=None,
                            doc="bytes kept free of the pool, replacing the rule (an eighth of the pool within "
                                "1-16 GiB)"),)


def _pool(machine: Machine, device_total: int) -> tuple[int, str]:
    """The pool's size as this process sees it, and how it was found."""
    size, how = machine.ram_total or device_total, "system memory"
    if machine.cgroup_limit is not None and machine.cgroup_limit < size:
        size, how = machine.cgroup_limit, f"the memory cgroup's limit (system memory {_gb(machine.ram_total)})"
    return size, how


def probe(machine: Machine, settings: PlatformValues | None = None) -> Candidate:
    """Fits when every CUDA device is integrated and supports virtual memory management; pure
    (machine facts only, no GPU context). (A ``headroom`` setting that is no size never gets here: membackend
    refuses it when it reads the settings, so the doctor shows the backend as broken with that message.) A
    ``headroom`` setting as large as the pool scores 0 with the key and its source named, so selection goes
    on with another backend.
    """
    name = PLATFORM_NAME
    cuda = machine.gpus("cuda")
    if not cuda:
        others = machine.gpus()
        seen = f" (found {', '.join(f'{d.device} {d.name}'.strip() for d in others)})" if others else ""
        return Candidate(name, Score.NONE, f"no CUDA device{seen}; this platform serves integrated CUDA devices "
                                           "(GB10, Jetson)")
    integrated = [d for d in cuda if d.integrated]
    discrete = [d for d in cuda if not d.integrated]
    if not integrated:
        d = discrete[0]
        why = " (unified addressing alone is not a shared pool)" if d.unified else ""
        return Candidate(name, Score.NONE, f"{d.device} {d.name} is not integrated{why}: it has "
                                           f"{_gb(d.total_memory)} of its own memory; the generic vmm serves it")
    if discrete:
        return Candidate(name, Score.NONE, f"{integrated[0].device} {integrated[0].name} is integrated but "
                                           f"{discrete[0].device} {discrete[0].name} is discrete: one pool's budget "
                                           "cannot serve both; the generic vmm serves them")
    lacking = vmm_unsupported(integrated)
    if lacking:
        return Candidate(name, Score.NONE, lacking)
    d = integrated[0]
    size, how = _pool(machine, d.total_memory)
    wanted = None if settings is None else settings["headroom"]
    if wanted is not None and size and wanted >= size:
        return Candidate(name, Score.NONE, f"{name}.headroom ({settings.source('headroom')}) is {wanted} bytes, "
                                           f"not less than the {_gb(size)} pool ({how}); accepted: a size below "
                                           f"the pool")
    more = f" and {len(integrated) - 1} more" if len(integrated) > 1 else ""
    return Candidate(name, SCORE, f"{d.device} {d.name}{more} is integrated (from "
                                  f"{d.source_of('integrated') or d.source or 'the machine facts'}): one "
                                  f"{_gb(size)} pool ({how}) shared "
                                  "with the host; budget from MemAvailable, faults past it refused up front, "
                                  "models kept warm while it allows")


PLATFORM_NAME = "unified_gb10"

#: the one record this distribution publishes (entry point ``unified_gb10`` in ``membackend.backends``)
PLATFORM = Platform(
    name=PLATFORM_NAME,
    vendor="cuda",
    probe=probe,
    budget_source="unified",
    # membackend's one-pool rules (refused up front, released on full unload, no kept handles, no device-wide
    # sync: Linux cuMemUnmap synchronizes), shared with rocm_linux's APUs
    capabilities=ONE_POOL,
    page_size=PAGE_SIZE,
    headroom=headroom,
    settings=SETTINGS,
    description="integrated CUDA (GB10, Jetson): one pool shared with the host, budget from MemAvailable",
    version=__version__,
)
