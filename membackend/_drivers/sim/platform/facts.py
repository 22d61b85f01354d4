"""Facts: what the driver and the operating system report about the devices and the host's memory (free and
total, ``/proc/meminfo``, amdgpu's sysfs, DXGI's budget, the adapter's LUID and PCI location), whether more
device memory fits, and the driver's own tables for a ledger to be checked against.

Where a behaviour comes from:

* Sysmem fallback past the budget: ComfyUI PR #11845, aimdo
  ``shmem-detect.c`` (DXGI QueryVideoMemoryInfo Budget).
* Unified memory: MemFree excludes the page cache that MemAvailable counts
  (proc(5), /proc/meminfo); device pages and host copies share the pool
  (ComfyUI #15285, unsloth PR #11208).
* AMD APUs and AMD GPUs on Linux (public reports, membackend issue 27): on
  Strix Halo a BIOS carve-out shows as sysfs VRAM and the rest is GTT
  (``mem_info_gtt_total`` = ``ttm.pages_limit`` x 4096, Linux amdgpu
  documentation); ``hipMemGetInfo`` reported free 120.00 GiB above its total
  of 62.47 GiB (``hip_free_is_host_free``: free is the host's MemFree, total
  the GTT).
"""

from __future__ import annotations

from typing import Callable, Mapping

from .state import SimDevice, SimError, SimHandle, SimMapping, SimOp, SimReservation, SimState, locked

__all__ = ["Facts", "Tables"]


class Facts:
    """The device and host memory figures of ``state``'s process; ``device(index)`` and ``current()`` are the
    contexts'."""

    def __init__(self, state: SimState, device: Callable[[int], SimDevice], current: Callable[[], int]):
        self.lock = state.lock
        self._state = state  # the host's figures, the spill counter
        self._profile = state.profile
        self._devices = state.devices
        self._device = device
        self._current = current

    def luid(self, device: int) -> bytes:
        """The adapter LUID (8 bytes: LowPart, HighPart, little-endian) DXGI would know the device by."""
        self._device(device)
        return (0x0000C0DE + device).to_bytes(4, "little") + (0).to_bytes(4, "little")

    def pci_location(self, device: int) -> tuple[int, int, int]:
        """(domain, bus, device) of the simulated board: one bus per device."""
        self._device(device)
        return 0, 0x01 + device, 0

    @locked
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as the driver reports them for the current device."""
        d = self._device(self._current())
        if self._profile.hip_free_is_host_free:  # Strix Halo: free above total (issue 27's reports)
            return self.meminfo()["MemFree"], d.vram
        if self._profile.unified:
            info = self.meminfo()
            return info["MemFree"], info["MemTotal"]  # MemFree, not MemAvailable (#15285)
        return max(0, d.vram - d.used), d.vram

    @locked
    def meminfo(self) -> dict[str, int]:
        """The host's /proc/meminfo view: MemAvailable counts the reclaimable page cache."""
        total = self._profile.host_ram
        if self._profile.unified:
            used = self._state.host_used + sum(d.used for d in self._devices)
        else:  # WDDM spill lives in system memory
            used = self._state.host_used + sum(d.spilled for d in self._devices)
        free = max(0, total - used - self._state.page_cache)
        return {"MemTotal": total, "MemFree": free, "MemAvailable": max(0, total - used)}

    @locked
    def amdgpu_sysfs(self, device: int) -> dict[str, int]:
        """The amdgpu driver's ``mem_info_*`` files of the device: on an APU the carve-out as VRAM and
        device memory as GTT; on a discrete card its VRAM, and a GTT of half the host's RAM, unused."""
        d, p = self._device(device), self._profile
        if d.integrated:
            return {"vram_total": p.carveout, "vram_used": 0, "gtt_total": p.gtt or d.vram, "gtt_used": d.used}
        return {"vram_total": d.vram, "vram_used": d.used, "gtt_total": p.host_ram // 2, "gtt_used": 0}

    @locked
    def wddm_budget(self, device: int) -> int:
        """DXGI QueryVideoMemoryInfo(LOCAL).Budget: VRAM minus what the OS keeps."""
        return self._device(device).vram - self._profile.wddm_budget_headroom

    def charge(self, d: SimDevice, size: int) -> None:
        """Whether ``size`` more bytes fit on ``d`` (its VRAM; one pool: the host's available memory and the
        GTT; WDDM: past VRAM into shared system memory, counted as spilled); ``SimError("oom")`` if not.
        Takes what it needs of the page cache on one pool, as the kernel reclaims it before failing."""
        p, state = self._profile, self._state
        if p.unified:
            if self.meminfo()["MemAvailable"] < size:
                raise SimError("oom", f"{size} bytes past the unified pool")
            if p.gtt and d.used + size > p.gtt:  # an AMD APU's device memory is GTT, ttm.pages_limit bounds it
                raise SimError("oom", f"{size} bytes past the {p.gtt} byte GTT")
            take_cache = min(state.page_cache, max(0, size - self.meminfo()["MemFree"]))
            state.page_cache -= take_cache
        elif d.used + size > d.vram:
            if not p.wddm:
                raise SimError("oom", f"{size} bytes past {d.vram} bytes of VRAM")
            # WDDM sysmem fallback: the allocation succeeds in shared memory
            over = min(size, d.used + size - d.vram)
            if self.meminfo()["MemAvailable"] < over:
                raise SimError("oom", "shared system memory exhausted too")
            state.spilled_bytes += over


class Tables:
    """The driver's own tables, summed (sim only): the address space's ``reservations``, the mapping table's
    ``mappings``, the live ``handles`` and ``pending_all()``, the work not done yet. ``lock`` is the
    platform's."""

    def __init__(self, lock: object, reservations: Mapping[int, SimReservation], mappings: Mapping[int, SimMapping],
                 handles: Mapping[int, SimHandle], pending_all: Callable[[], list[SimOp]]):
        self.lock = lock
        self._reservations, self._mappings, self._handles = reservations, mappings, handles
        self._pending_all = pending_all

    @locked
    def state(self, device: int | None = None) -> dict[str, int]:
        """What the driver holds, for checking a ledger against: per device, or the whole process."""
        def pick(items, dev_of):
            return [x for x in items if device is None or dev_of(x) == device]

        return {
            "reserved": sum(r.size for r in pick(self._reservations.values(), lambda r: r.device)),
            "reservations": len(pick(self._reservations.values(), lambda r: r.device)),
            "mapped": sum(m.size for m in pick(self._mappings.values(), lambda m: m.device)),
            "handles": len(pick(self._handles.values(), lambda h: h.device)),
            "physical": sum(h.size for h in pick(self._handles.values(), lambda h: h.device)),
            "pending_ops": len(pick(self._pending_all(), lambda o: o.device)),
        }
