"""The mapping table: every mapping of the process by address, and the look-ups over it.

Where a behaviour comes from:

* RDNA4 reports 4 KiB VMM granularity but kernels fault on mappings aligned
  to less than 2 MiB (``map_fault_below``, public reports, membackend issue
  27): such a mapping succeeds, and work that touches it is a GPU memory
  access fault, counted as an illegal address.
"""

from __future__ import annotations

import bisect

from .state import SimError, SimMapping, SimState

__all__ = ["MappingTable"]


class MappingTable:
    """The process's mappings (``mappings``: address -> mapping), their sorted start addresses and the bytes
    they map together (``mapped_total``, which counts against the address quota). Not locked: the parts that
    call it hold the platform's lock."""

    def __init__(self, state: SimState):
        self._state = state  # counts illegal addresses
        self._profile = state.profile
        self.mappings: dict[int, SimMapping] = {}
        self._starts: list[int] = []  # sorted mapping addresses, for range look-ups
        self.mapped_total = 0

    def add(self, m: SimMapping) -> None:
        self.mappings[m.va] = m
        bisect.insort(self._starts, m.va)
        self.mapped_total += m.size

    def remove(self, m: SimMapping) -> None:
        del self.mappings[m.va]
        del self._starts[bisect.bisect_left(self._starts, m.va)]
        self.mapped_total -= m.size

    def overlapping(self, va: int, size: int) -> list[SimMapping]:
        """Mappings that intersect ``[va, va+size)``, in address order."""
        i = bisect.bisect_right(self._starts, va) - 1
        found = []
        for start in self._starts[max(i, 0):]:
            if start >= va + size:
                break
            m = self.mappings[start]
            if m.va + m.size > va:
                found.append(m)
        return found

    def exact(self, va: int, size: int) -> list[SimMapping]:
        """Whole mappings exactly covering the range: a sub-range is invalid (cuMemUnmap docs)."""
        found, pos = [], va
        while pos < va + size:
            m = self.mappings.get(pos)
            if m is None:
                raise SimError("invalid", f"{pos:#x} does not start a mapping")
            found.append(m)
            pos += m.size
        if pos != va + size:
            raise SimError("invalid", "the range ends inside a mapping")
        return found

    def handles_in(self, va: int, size: int, need_access: bool, kind: str = "invalid") -> frozenset:
        """The handles mapped over all of ``[va, va+size)``; ``SimError(kind)`` where a part of it is not
        mapped (or, with ``need_access``, has no access set); a trapped mapping touched with access is an
        ``illegal_address``, counted."""
        found, pos = set(), va
        for m in self.overlapping(va, size):
            if m.va > pos:
                break
            if need_access and not m.access:
                raise SimError(kind, f"range at {m.va:#x} has no access set (cuMemSetAccess)")
            if need_access and m.trapped:  # RDNA4: kernels fault on mappings aligned to less than 2 MiB
                self._state.illegal_addresses += 1
                raise SimError("illegal_address", f"memory access fault by GPU: the mapping at {m.va:#x} "
                                                  f"({m.size} bytes) is aligned to less than "
                                                  f"{self._profile.map_fault_below} bytes")
            found.add(m.handle)
            pos = m.va + m.size
        if pos < va + size:
            raise SimError(kind, f"range [{va:#x}, {va + size:#x}) is not fully mapped")
        return frozenset(found)
