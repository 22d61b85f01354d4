"""The process's GPU address space: reservations of virtual ranges, their quota and their commit charge.

Where a behaviour comes from:

* Reservations are freed only when unmapped (CUDA driver API reference,
  "Virtual Memory Management": cuMemAddressFree; the module docstring of
  :mod:`.handles` has the rest of the VMM call rules).
* ROCm/Windows commit-charged reservations: ComfyUI #15993. The 256 GiB
  address quota and its access violation: rocm-systems #9823 / ComfyUI PR
  #16199. The churn defect: rocm-systems #6191, aimdo PR #67.
* Address space: the devices' virtual addresses are the process's (CUDA C Programming Guide, "Unified
  Virtual Address Space"), so reservations together get at most the process's user address space,
  ``va_space`` (128 TiB: x86-64 Linux with 4-level page tables, the kernel's
  Documentation/arch/x86/x86_64/mm.rst); past it ``cuMemAddressReserve`` is CUDA_ERROR_OUT_OF_MEMORY (CUDA
  driver API reference, cuMemAddressReserve's return values, cuda.h) and ``hipMemAddressReserve``
  hipErrorOutOfMemory (ROCm clr, hipamd/src/hip_vm.cpp: no range found), in books-only mode too. Where
  the bytes are real, the kernel may refuse a range earlier (the rest of the process shares its space):
  the same answer.
"""

from __future__ import annotations

from typing import Callable, KeysView

from ..memory import MemoryCallFailed
from .mappings import MappingTable
from .state import NO_FILES, SimError, SimReservation, SimState, SimulatedCrash, check_granular, locked

__all__ = ["AddressSpace", "VA_BASE", "VA_SPACE"]

VA_BASE = 0x7F00_0000_0000  # where books-only reservations start
#: bytes of address space all reservations together may hold (see the module docstring)
VA_SPACE = 1 << 47


class AddressSpace:
    """The reservations (base -> reservation) of ``state``'s process. ``table`` is the mapping table (a
    reservation with mappings is not freed; mapped bytes count against the quota), ``current()`` and
    ``check_current(device, what)`` the contexts', ``range_freed(live)`` hands back the memory of released
    handles whose ranges are all gone (ROCm 7.2), given the bases still reserved."""

    def __init__(self, state: SimState, table: MappingTable, current: Callable[[], int],
                 check_current: Callable[[int, str], None], range_freed: Callable[[KeysView[int]], None]):
        self.lock = state.lock
        self._profile = state.profile
        self._memory = state.memory
        self._state = state  # counts crashes
        self._table = table
        self._current = current
        self._check_current = check_current
        self._range_freed = range_freed
        self.reservations: dict[int, SimReservation] = {}
        #: the process's address space for reservations, :data:`VA_SPACE`; a test may make it smaller to fill
        #: it with a few models
        self.va_space = VA_SPACE
        self._next_va = VA_BASE
        self._reserved_total = 0
        self.churn_frees = 0
        self.private_commit = 0

    @locked
    def quota_used(self) -> int:
        return self._reserved_total + self._table.mapped_total

    @locked
    def reserve(self, size: int, alignment: int) -> int:
        """``cuMemAddressReserve`` / ``hipMemAddressReserve``: the base of a new range of ``size`` bytes."""
        p = self._profile
        check_granular(p.granularity, size, "reservation size")
        if p.address_quota is not None and self.quota_used() + size > p.address_quota:
            self._state.crashes += 1
            raise SimulatedCrash(f"access violation 0xC0000005: {size} more bytes of GPU address space past the "
                                 f"{p.address_quota} byte per-process quota")
        if p.churn_limit is not None and size >= p.churn_window and self.churn_frees >= p.churn_limit:
            raise SimError("oom", f"reserve failed after {self.churn_frees} reserve/free cycles of large windows")
        if self._reserved_total + size > self.va_space:  # the address space is full: out of memory (docstring)
            raise SimError("oom", f"address reserve of {size} bytes: {self._reserved_total} of the process's "
                                  f"{self.va_space} bytes of address space are reserved")
        align = max(alignment or 0, p.granularity)
        if self._memory.backed:
            try:
                base = self._memory.reserve(size, align)
            except MemoryCallFailed as exc:  # the process's address space is full: out of memory (docstring)
                if exc.errno in NO_FILES:
                    raise  # no descriptor left for the memory file: the caller's error names the limit
                raise SimError("oom", f"address reserve of {size} bytes: {exc}") from None
        else:
            base = -(-self._next_va // align) * align
            self._next_va = base + size
        self.reservations[base] = SimReservation(base, size, self._current())
        self._reserved_total += size
        if p.private_commit_reservations:
            self.private_commit += size
        return base

    @locked
    def free(self, base: int, size: int) -> None:
        """``cuMemAddressFree`` / ``hipMemAddressFree``: the whole reservation at ``base``, once unmapped."""
        r = self.reservations.get(base)
        if r is None or r.size != size:
            raise SimError("invalid", f"no reservation of {size} bytes at {base:#x}")
        self._check_current(r.device, "the reservation")
        if self._table.overlapping(base, size):
            raise SimError("invalid", f"reservation at {base:#x} still has mappings")
        del self.reservations[base]
        self._reserved_total -= size
        self._range_freed(self.reservations.keys())  # ROCm 7.2: memory held until its last range is freed
        if self._memory.backed:
            self._memory.unreserve(base, size)
        if self._profile.private_commit_reservations:
            self.private_commit -= size
        if self._profile.churn_limit is not None and size >= self._profile.churn_window:
            self.churn_frees += 1
