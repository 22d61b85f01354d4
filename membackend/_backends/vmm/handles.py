"""The handle keeper and recycler: where a physical handle goes once it is no longer mapped.

Chosen by the capabilities' ``handles`` group (``Capabilities.GROUPS``):

* :class:`HandleKeeper` (every platform): an unmapped handle is released, or, under ``recycle_handles``, kept
  on its device (at most ``recycle_limit``) for the next fault to map without asking the driver; kept handles
  count as free to the budget and go back first when the device runs short (the budget query) and on trim;
* :class:`RangeHeldHandles` (``memory_returns_on_unmap`` false, ROCm 7.2): the driver gives a released handle's
  memory back only when the address range it was mapped in is freed, so an unmapped handle stays with its own
  reservation for that reservation's next fault, and is released just before the range is freed.

A handle whose release fails is kept by its device either way (trim or the next fault takes it). Called under
the backend's lock, with the device current.
"""

from __future__ import annotations

from typing import Any, Callable

from ..._drivers.gpu import GpuDriver
from ...types import Capabilities, DriverError
from .state import DeviceState, PageTable


class HandleKeeper:
    """Unmapped handles are released, or recycled on their device under ``recycle_handles``."""

    def __init__(self, capabilities: Capabilities, driver: Callable[[], GpuDriver]):
        self.recycles = capabilities.recycle_handles
        self.limit = capabilities.recycle_limit  # None: bounded by the budget alone
        self._driver = driver

    @staticmethod
    def take(state: DeviceState, table: PageTable) -> Any:
        """A kept handle for a page of ``table``: its own first (mapped there before), then the device's;
        None when neither keeps one (the caller creates one)."""
        if table.spare:
            return table.spare.pop()
        return state.spare.pop() if state.spare else None

    def not_mapped(self, state: DeviceState, table: PageTable, handle: Any) -> None:
        """A handle a failed fault created or took and could not map: kept for a later fault."""
        state.spare.append(handle)

    def unmapped(self, state: DeviceState, table: PageTable, handle: Any, releasing: bool = False) -> None:
        """A handle just unmapped from ``table`` by a free or a rolled-back fault (``releasing``: by the
        release of ``table``): released, or kept on the device (:meth:`release_or_keep`)."""
        self.release_or_keep(state, handle)

    def release_or_keep(self, state: DeviceState, handle: Any) -> None:
        """Release an unmapped handle, or keep it for reuse (recycling, or when release fails)."""
        if self.recycles and (self.limit is None or len(state.spare) < self.limit):
            state.spare.append(handle)
            return
        try:
            self._driver().release(handle)
        except DriverError:
            state.spare.append(handle)  # still ours: trim() or the next fault takes it

    def release_with_range(self, state: DeviceState, table: PageTable) -> None:
        """Release the handles kept with ``table``, which is being released: freeing the range then returns
        their memory (ROCm 7.2). One whose release fails is kept by the device, as any other."""
        while table.spare:
            handle = table.spare.pop()
            try:
                self._driver().release(handle)
            except DriverError:
                state.spare.append(handle)

    def counted_free(self, state: DeviceState, free: int, room: int) -> int:
        """The device's ``free`` bytes as the budget counts them, with ``room`` the headroom in force.

        Recycling, kept handles are usage to the driver, but the next fault maps them without asking it:
        free to the policy. When the driver's own free falls below the headroom they go back first (quiet:
        every free fenced them before they were unmapped), so the pool shrinks as the budget needs the memory
        and can never push a WDDM device into sysmem fallback."""
        if not self.recycles:
            return free
        while state.spare and free < room:
            self._driver().release(state.spare[-1])
            state.spare.pop()
            free += state.page_size
        return free + len(state.spare) * state.page_size

    def trim(self, state: DeviceState) -> int:
        """Release every handle the device keeps; returns their bytes."""
        released = 0
        while state.spare:
            self._driver().release(state.spare[-1])
            state.spare.pop()
            released += state.page_size
        return released


class RangeHeldHandles(HandleKeeper):
    """Memory returns only when the range is freed (ROCm 7.2): an unmapped handle stays with its range.

    A release would return nothing while the range lives, so its next fault maps the handle again; the
    range's own release gives its handles back just before the range is freed (:meth:`release_with_range`)."""

    def not_mapped(self, state: DeviceState, table: PageTable, handle: Any) -> None:
        table.spare.append(handle)  # with its range, where it was mapped before

    def unmapped(self, state: DeviceState, table: PageTable, handle: Any, releasing: bool = False) -> None:
        if releasing:
            self.release_or_keep(state, handle)
        else:
            table.spare.append(handle)
