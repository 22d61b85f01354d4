"""The ``Platform`` record: what a platform plugin contributes, as data plus a probe.

A platform is everything the generic virtual-memory backend needs to know to
serve one kind of machine well: its name (the backend's name), its vendor
(which driver bindings), a probe that says when it fits, where its budget
comes from, the :class:`~membackend.types.Capabilities` that tune the
residency policy, and defaults (page size, headroom). The mechanism is the
same for all of them: :class:`membackend._backends.vmm.VmmBackend` is *built
from* a Platform and a driver and names itself after the platform.

A platform plugin is one module with one ``Platform`` and one entry point in
the ``membackend.backends`` group naming it::

    [project.entry-points."membackend.backends"]
    my_platform = "my_package:PLATFORM"

The built-in generic platform is :data:`GENERIC` (backend name ``vmm``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ._drivers.gpu import BUDGET_SOURCES
from .types import Candidate, Capabilities, DeviceInfo, Machine, Score

__all__ = ["Platform", "GENERIC", "vmm_unsupported", "KEPT_WINDOWS_PER_DEVICE", "CHURN_MARGIN"]

MiB = 1 << 20
#: kept address windows per device under a reserve-churn limit, at least this bound (more where the device
#: had more large reservations alive at once): what stays reserved once the platform allows no more frees
KEPT_WINDOWS_PER_DEVICE = 4
#: large frees left unspent under a reserve-churn limit (the limit is one reproducer's count, rocm-systems #6191)
CHURN_MARGIN = 2
NAME_PATTERN = r"^[a-z][a-z0-9_\-]*$"


@dataclass(frozen=True)
class Platform:
    """One platform; see the module docstring.

    * ``probe(machine) -> Candidate``: pure (no GPU context, no allocation);
      score on :class:`~membackend.types.Score`'s scale. The backend adds the
      check that the vendor's bindings are installed.
    * ``vendor``: ``cuda`` or ``hip``; None only for the generic platform,
      which follows the machine's torch build.
    * ``budget_source``: ``device`` (mem-get-info), ``wddm`` (the DXGI
      video-memory budget) or ``unified`` (MemAvailable capped by the cgroup).
    * ``page_size``: rounded up to the driver's granularity per device.
    * ``headroom``: bytes kept free on every device (for activations, and
      what the OS needs), or a function of the device's total bytes (e.g. a
      fraction of a unified pool within bounds); a ``headroom`` setting
      replaces it.
    """

    name: str
    probe: Callable[[Machine], Candidate]
    vendor: str | None = None
    budget_source: str = "device"
    capabilities: Capabilities = field(default_factory=Capabilities)
    page_size: int = 2 * MiB
    headroom: int | Callable[[int], int] = 256 * MiB  # comfy-aimdo keeps this much VRAM free (VRAM_HEADROOM)
    description: str = ""
    version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.match(NAME_PATTERN, self.name):
            raise ValueError(f"platform name {self.name!r} must match {NAME_PATTERN}")
        if self.vendor not in (None, "cuda", "hip"):
            raise ValueError(f"platform {self.name!r}: vendor {self.vendor!r}; accepted: cuda, hip")
        if self.budget_source not in BUDGET_SOURCES:
            raise ValueError(f"platform {self.name!r}: budget source {self.budget_source!r}; "
                             f"accepted: {', '.join(BUDGET_SOURCES)}")
        if not callable(self.probe):
            raise ValueError(f"platform {self.name!r}: probe must be callable(machine) -> Candidate")
        if self.page_size <= 0 or (not callable(self.headroom) and self.headroom < 0):
            raise ValueError(f"platform {self.name!r}: page_size must be > 0 and headroom >= 0 "
                             "(or a function of the device's total bytes)")

    def headroom_for(self, total: int) -> int:
        """The headroom in bytes on a device of ``total`` bytes."""
        value = self.headroom(total) if callable(self.headroom) else self.headroom
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"platform {self.name!r}: headroom({total}) gave {value!r}; accepted: an int >= 0")
        return value


_VMM_ATTRIBUTE = {"cuda": "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                  "hip": "hipDeviceAttributeVirtualMemoryManagementSupported"}


def vmm_unsupported(gpus: tuple[DeviceInfo, ...] | list[DeviceInfo]) -> str | None:
    """Why a virtual-memory backend cannot serve ``gpus``, or None when every one supports virtual
    memory management (``DeviceInfo.vmm_supported`` is true).

    A device that reports no support fails its first ``cuMemCreate`` / ``hipMemCreate`` with
    ...NOT_SUPPORTED; one whose support is unknown was not listed through the driver API (NVML or
    ``/proc`` only, or a driver that did not answer), which a VMM backend needs anyway. Every VMM
    probe scores 0 with this reason.
    """
    for d in gpus:
        if d.vmm_supported:
            continue
        attr = _VMM_ATTRIBUTE.get(d.device.kind, "virtual memory management support")
        named = f"{d.device} ({d.name or 'unnamed'})"
        if d.vmm_supported is False:
            return (f"{named} does not support virtual memory management ({attr} = 0, from "
                    f"{d.source_of('vmm_supported') or d.source}); the host backend serves it")
        return (f"{named}: virtual memory management support is unknown ({attr} was not answered; the device "
                f"was listed by {d.source or 'nothing'}), and a VMM backend needs the driver API that answers it")
    return None


def _generic_probe(machine: Machine) -> Candidate:
    """Any CUDA or HIP device (HIP's when torch is a ROCm build), each supporting virtual memory
    management; score 20, in the generic band."""
    vendor = "hip" if machine.torch_vendor == "rocm" else None
    gpus = machine.gpus(vendor)
    if not gpus:
        return Candidate("vmm", Score.NONE, f"no {vendor.upper() if vendor else 'CUDA or HIP'} device found")
    kind = gpus[0].device.kind
    gpus = machine.gpus(kind)
    lacking = vmm_unsupported(gpus)
    if lacking:
        return Candidate("vmm", Score.NONE, lacking)
    names = ", ".join(sorted({d.name or str(d.device) for d in gpus}))
    return Candidate("vmm", 20, f"generic VMM over {kind} on {len(gpus)} device(s): {names}")


#: the built-in generic platform: any CUDA or HIP device, budget from mem-get-info. A free waits for the
#: fence tokens recorded on its range; the device is synchronized after fresh mappings only on devices
#: under WDDM (``page_in_sync="wddm"``: Windows, TCC aside), whose video memory manager pages them in
#: behind the process's back, work no token covers (ComfyUI #16246). Elsewhere nothing pages them in
#: (and Linux cuMemUnmap is itself "synchronous for most use cases", CUDA driver API), so a device-wide
#: sync would only stall every other stream, torch's included.
GENERIC = Platform(
    name="vmm",
    probe=_generic_probe,
    capabilities=Capabilities(page_in_sync="wddm"),
    description="generic virtual-memory backend over the CUDA or HIP driver",
)
