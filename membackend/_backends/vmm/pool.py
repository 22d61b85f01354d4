"""A device's memory as the platform measures it, and the one-pool guard.

* :class:`PoolBudget` (every platform) reads the platform's budget source: ``device``, ``wddm``, ``unified``,
  ``apu``, or ``auto`` (the pool on a device that shares one with the host, the device's figures elsewhere);
* :class:`OnePoolGuard`, chosen by the capabilities' ``one_pool`` group (``unified_pool``) or a budget source
  that can measure one pool (``unified``, ``apu``, ``auto``): on one pool shared with the host (GB10, an AMD
  APU) a fault that would cross it is out of memory before the driver is asked (a GB10 driver refusing late
  ends in NV_ERR_NO_MEMORY and aborts, ComfyUI #15285), and budgets say the pool is unified;
* :class:`RoomSplit`: where a device's memory goes under the headroom in force (``VmmBackend.room_split``).

Called under the backend's lock, with the device current.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..._drivers.gpu import GpuDriver
from ...types import Machine
from .state import DeviceState, PageTable

#: the budget sources that measure one pool shared with the host (``auto``: where the device is integrated)
ONE_POOL_SOURCES = ("unified", "apu")


@dataclass(frozen=True)
class RoomSplit:
    """Where one device's memory goes under the headroom in force (:meth:`VmmBackend.room_split`), in bytes.

    * ``total``, ``free``: the platform's budget source (``source``), as every budget reads it;
    * ``headroom``: the headroom in force (``--reserve-vram``, ``--vram-headroom``, a live cap, the setting or
      the platform's rule); ``room = max(0, total - headroom)``: what the process may hold on the device;
    * ``held``: what membackend's own handles hold (resident pages and kept handles);
    * ``other = max(0, total - free - held)``: everything else the driver counts as used: the process's other
      use (its context, its runtime allocator: activations, cast buffers) and, where the source cannot tell
      processes apart (a device's mem-get-info), other processes' too;
    * ``weights_room = max(0, room - other)``: what the weights may hold, never counting the process's own
      use twice; ``resident``: the weights' pages resident now (``held`` less kept handles).

    The budget's ``usable`` is ``weights_room - held`` clamped at 0 (kept handles count as free to it)."""

    total: int
    free: int
    headroom: int
    room: int
    held: int
    other: int
    weights_room: int
    resident: int
    source: str

    @classmethod
    def measured(cls, total: int, free: int, headroom: int, state: DeviceState, source: str) -> "RoomSplit":
        """The split of a device whose budget source (``source``) reads ``total`` and ``free``, under
        ``headroom``, with what ``state`` holds: resident pages and the handles the device keeps."""
        held = state.resident + len(state.spare) * state.page_size
        room = max(0, total - headroom)
        other = max(0, total - free - held)
        return cls(total, free, headroom, room, held, other, max(0, room - other), state.resident, source)

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "free": self.free, "headroom": self.headroom, "room": self.room,
                "held": self.held, "other": self.other, "weights_room": self.weights_room,
                "resident": self.resident, "source": self.source}


class PoolBudget:
    """``read(index, state)``: ``(total, free, source)`` of one device from the platform's ``budget_source``.

    ``auto``: the pool on a device that shares one with the host, whose mem-get-info reports ``MemFree``
    without the reclaimable page cache (G3, ComfyUI #15285) -- on an AMD APU the smallest of three figures,
    ``apu``; the device's own figures elsewhere. A ``unified`` pool is capped by the machine facts a user set
    (``machine.ram_total``) and by the memory cgroup's limit the facts carry; an APU's is not by the cgroup:
    its GTT allocations are not charged to it (hipMalloc on Strix Halo is not limited by a cgroup)."""

    def __init__(self, source: str, driver: Callable[[], GpuDriver], machine: Callable[[], Machine | None]):
        self.source = source
        self._driver = driver
        self._machine = machine

    def read(self, index: int, state: DeviceState) -> tuple[int, int, str]:
        source = self.source
        if source == "auto":  # an AMD APU's pool has three figures, none to trust alone (``apu``)
            source = ("apu" if self._driver().vendor == "hip" else "unified") if state.integrated else "device"
        total, free, label = self._driver().budget(source, index)
        if source != "unified":
            return total, free, label
        facts = self._machine()
        caps: list[tuple[int, str]] = []
        if facts is not None and "ram_total" in facts.overridden and facts.ram_total is not None:
            caps.append((facts.ram_total, "machine.ram_total"))
        if facts is not None and facts.cgroup_limit is not None:
            caps.append((facts.cgroup_limit, "the memory cgroup's limit"))
        for cap, why in caps:
            if cap < total:  # the same use, of a smaller pool
                used = total - free
                total, free, label = cap, max(0, min(free, cap - used)), f"{label}, capped by {why}"
        return total, free, label


class OnePoolGuard:
    """Refuses a fault that would cross one pool shared with the host, before the driver is asked.

    ``every_device``: the capability or the budget source says every device is one pool; else (``auto``)
    the devices found integrated are. ``room(index, total)`` is the headroom in force."""

    def __init__(self, every_device: bool, budget: PoolBudget, room: Callable[[int, int], int]):
        self.every_device = every_device
        self._budget = budget
        self._room = room

    def applies(self, state: DeviceState) -> bool:
        """Whether the device shares one pool with the host."""
        return self.every_device or state.integrated

    def has_room(self, table: PageTable, first: int, last: int, state: DeviceState) -> bool:
        """Whether faulting pages ``[first, last)`` of ``table`` stays within the pool less the headroom
        (handles the device or the range keeps need no new memory)."""
        need = sum(1 for p in range(first, last) if table.handles[p] is None) - len(state.spare) - len(table.spare)
        if need <= 0:
            return True
        total, free, _source = self._budget.read(table.index, state)
        return need * state.page_size <= free - self._room(table.index, total)
