"""Physical handles and their mappings: create, release, map, set access, unmap.

Where a behaviour comes from:

* VMM call rules (granularity multiples, whole-mapping unmaps, access after
  map, reservations freed only when unmapped): CUDA driver API reference,
  "Virtual Memory Management" (cuMemAddressReserve, cuMemCreate, cuMemMap,
  cuMemUnmap, cuMemSetAccess, cuMemRelease); HIP mirrors it (hip_runtime_api.h).
* WDDM deferred page-in (VidMm makes a mapped allocation resident
  asynchronously): ComfyUI #16246.
* The 256 GiB address quota and its access violation: rocm-systems #9823 /
  ComfyUI PR #16199 (a map past it crashes the process as a reserve does).
* AMD GPUs on Linux (public reports, membackend issue 27): ROCm 7.2 returns a
  released handle's memory only when the address range it was mapped in is
  freed, not on unmap alone (vLLM frees and re-reserves the range):
  ``memory_held_until_address_free``.
* ROCm 7.14 on Linux holds one dmabuf file descriptor of the process per live
  ``hipMemCreate`` handle, where ROCm 7.1.1 kept 3 in all (ROCm/rocm-systems
  #10604; ROCm/legacy-rocm-build #6661): gfx1030, gfx1100, gfx1151 and gfx1201
  stop at 1,015 handles under ``ulimit -n 1024``, and the call answers
  hipErrorOutOfMemory although what ran out is the descriptors
  (``Profile.descriptor_per_handle``). The simulation takes no real descriptor:
  it counts its live handles on top of the descriptors the process has open
  (``process_descriptors``) against the process's soft ``RLIMIT_NOFILE``, read
  at each create (so a raised limit counts at once), and counts each refusal
  (``descriptor_refusals``).
* A device without virtual memory management support fails ``cuMemCreate`` /
  ``hipMemCreate`` with ...NOT_SUPPORTED (CUDA driver API reference,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; ROCm/hip #3151).
"""

from __future__ import annotations

from typing import Callable, KeysView

from ...gpu import nofile_limits, process_descriptors
from ..memory import MemoryCallFailed
from .mappings import MappingTable
from .state import (
    NO_FILES,
    SimDevice,
    SimError,
    SimHandle,
    SimMapping,
    SimOp,
    SimReservation,
    SimState,
    SimulatedCrash,
    check_granular,
    locked,
)

__all__ = ["Handles"]


class Handles:
    """The live handles (id -> handle) of ``state``'s process and the released ones ROCm 7.2 still holds
    (``held_released``), mapped through ``table`` into ``reservations``.

    What it calls, each bound once: ``quota_used()`` (the address space's), ``device(index)`` and
    ``check_current(device, what)`` (the contexts'), ``charge(device, size)`` (the facts': whether the bytes
    fit), ``queue(...)`` and ``release_check(handles, what)`` (the streams': a page-in, and memory that work
    still touches)."""

    def __init__(self, state: SimState, table: MappingTable, reservations: dict[int, SimReservation],
                 quota_used: Callable[[], int], device: Callable[[int], SimDevice],
                 check_current: Callable[[int, str], None], charge: Callable[[SimDevice, int], None],
                 queue: Callable[[int, int, float, frozenset, str], SimOp],
                 release_check: Callable[[set[int], str], None]):
        self.lock = state.lock
        self._state = state  # counts crashes and descriptor refusals
        self._profile = state.profile
        self._memory = state.memory
        self._devices = state.devices
        self._ids = state.ids
        self._table = table
        self._reservations = reservations
        self._quota_used = quota_used
        self._device = device
        self._check_current = check_current
        self._charge = charge
        self._queue = queue
        self._release_check = release_check
        self.handles: dict[int, SimHandle] = {}
        self.held_released: dict[int, SimHandle] = {}  # ROCm 7.2: released, memory held until its ranges are freed

    # ------------------------------------------------------------------ physical memory

    @locked
    def create(self, size: int, device: int) -> int:
        check_granular(self._profile.granularity, size, "allocation size")
        d = self._device(device)
        if not d.vmm:
            raise SimError("not_supported", f"device {device} does not support virtual memory management")
        self._check_current(device, "the allocation")
        self._take_descriptor()
        self._charge(d, size)
        offset = -1
        if self._memory.backed:
            try:
                offset = self._memory.create(size)
            except MemoryCallFailed as exc:
                if exc.errno in NO_FILES:
                    raise  # no descriptor left for the memory file: the caller's error names the limit
                raise SimError("oom", f"{size} bytes of device memory: {exc}") from None
        d.used += size
        h = SimHandle(next(self._ids), device, size, offset=offset)
        self.handles[h.id] = h
        return h.id

    def descriptors_held(self) -> int:
        """The process's file descriptors the simulated runtime holds now: one per live handle where the
        profile's runtime holds one (ROCm 7.14 on Linux, see the module docstring), else none."""
        return len(self.handles) if self._profile.descriptor_per_handle else 0

    def _take_descriptor(self) -> None:
        """ROCm 7.14: a new handle needs a descriptor under the process's soft ``RLIMIT_NOFILE``; without one
        the call answers out of memory, as the runtime does (``SimError("oom")``, counted)."""
        if not self._profile.descriptor_per_handle:
            return
        limits, open_now = nofile_limits(), process_descriptors()
        soft = limits[0] if limits is not None else None
        if soft is None or open_now is None:
            return  # no limit, or nothing to count against it
        if open_now + self.descriptors_held() >= soft:
            self._state.descriptor_refusals += 1
            raise SimError("oom", f"EMFILE behind out of memory: {open_now + self.descriptors_held()} of "
                                  f"{soft} file descriptors open, one per live handle")

    @locked
    def release(self, handle: int) -> None:
        h = self.handles.get(handle)
        if h is None or h.released:
            raise SimError("invalid", f"no handle {handle}")
        self._check_current(h.device, "the handle")
        self._release_check({handle}, "cuMemRelease")
        h.released = True
        if not h.mapped_at:  # freed once released and unmapped (cuMemRelease docs)
            self._drop(h)

    @locked
    def shed_memory(self) -> bool:
        """Close the process's device-memory file (its descriptor) now if nothing holds a range of it: no
        reservation, no handle, none released that ROCm 7.2 still holds. The next reservation or allocation
        opens a new one. Whether it was closed."""
        if not self._memory.backed or self._reservations or self.handles or self.held_released:
            return False
        return bool(self._memory.drop_file())

    def _drop(self, h: SimHandle) -> None:
        del self.handles[h.id]
        if self._profile.memory_held_until_address_free and h.ranges & self._reservations.keys():
            self.held_released[h.id] = h  # ROCm 7.2: returned when its ranges are freed, not now
            return
        self._give_back(h)

    def _give_back(self, h: SimHandle) -> None:
        self._devices[h.device].used -= h.size
        if h.offset >= 0:  # the memory is freed: released and no address maps it (cuMemRelease)
            self._memory.free(h.offset, h.size)

    def range_freed(self, live: KeysView[int]) -> None:
        """A reservation was freed: the held handles none of whose ranges is still ``live`` give their
        memory back now (ROCm 7.2)."""
        for h in [h for h in self.held_released.values() if not h.ranges & live]:
            del self.held_released[h.id]  # its last range is freed: now the memory goes back (ROCm 7.2)
            self._give_back(h)

    # ------------------------------------------------------------------ mappings

    @locked
    def map(self, va: int, size: int, offset: int, handle: int) -> None:
        h = self.handles.get(handle)
        if h is None or h.released:
            raise SimError("invalid", f"no handle {handle}")
        if offset != 0 or size != h.size:
            raise SimError("invalid", "offset must be 0 and size the handle's size")
        self._check_current(h.device, "the handle")
        r = next((r for r in self._reservations.values() if r.base <= va and va + size <= r.base + r.size), None)
        if r is None:
            raise SimError("invalid", f"[{va:#x}, {va + size:#x}) is not inside a reservation")
        if self._table.overlapping(va, size):
            raise SimError("invalid", f"[{va:#x}, {va + size:#x}) is already mapped")
        p = self._profile
        if p.address_quota is not None and self._quota_used() + size > p.address_quota:
            self._state.crashes += 1
            raise SimulatedCrash("access violation 0xC0000005: mapping past the per-process GPU address quota")
        if h.offset >= 0:
            try:
                self._memory.map(va, size, h.offset)
            except MemoryCallFailed as exc:
                raise SimError("oom", f"mapping {size} bytes at {va:#x}: {exc}") from None
        below = p.map_fault_below
        self._table.add(SimMapping(va, size, handle, h.device, trapped=bool(below and (va % below or size % below))))
        h.ranges.add(r.base)
        h.mapped_at.add(va)
        if p.wddm:  # VidMm makes the allocation resident asynchronously
            self._queue(h.device, -1, p.pagein_seconds, frozenset({handle}), "page-in")

    @locked
    def set_access(self, va: int, size: int, device: int) -> None:
        self._device(device)
        mappings = self._table.exact(va, size)
        for m in mappings:
            self._check_current(m.device, "the mapping")
        for m in mappings:
            if self.handles[m.handle].offset >= 0:
                self._memory.set_access(m.va, m.size)
            m.access = True

    @locked
    def unmap(self, va: int, size: int) -> None:
        mappings = self._table.exact(va, size)
        for m in mappings:
            self._check_current(m.device, "the mapping")
        self._release_check({m.handle for m in mappings}, "cuMemUnmap")
        for m in mappings:
            if self.handles[m.handle].offset >= 0:
                self._memory.unmap(m.va, m.size)
            self._table.remove(m)
            h = self.handles[m.handle]
            h.mapped_at.discard(m.va)
            if h.released and not h.mapped_at:
                self._drop(h)
