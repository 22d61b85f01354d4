"""Which mechanism parts a :class:`~.backend.VmmBackend` runs, chosen from its capabilities' groups.

Each group of ``Capabilities.GROUPS`` either chooses one part here or tunes the core:

=================== ================================================ ==============================================
group               fields                                           what it chooses
=================== ================================================ ==============================================
``handles``         ``recycle_handles``, ``recycle_limit``,          :class:`~.handles.HandleKeeper`;
                    ``memory_returns_on_unmap``                      :class:`~.handles.RangeHeldHandles` where
                                                                     memory returns only with its range (ROCm 7.2)
``address_windows`` ``address_quota``, ``reserve_churn_limit``,      :class:`~.windows.FreshWindows`;
                    ``reserve_churn_window``, ``reserve_churn_keep`` :class:`~.churn.ChurnWindowKeeper` under a
                                                                     reserve-churn limit (Windows ROCm)
``one_pool``        ``unified_pool``                                 :class:`~.pool.OnePoolGuard` where the
                                                                     capability or the budget source can say one
                                                                     pool (GB10, AMD APUs); none elsewhere
``self_test``       ``vmm_self_test``                                :class:`~.selftest.VmmSelfTest` (Strix Halo
                                                                     under WSL); none elsewhere
``descriptors``     ``handle_descriptors``                           :class:`~.descriptors.HandleDescriptors` where
                                                                     each handle holds a file descriptor (ROCm
                                                                     7.14 on Linux); none elsewhere
``fencing``         ``fence_granularity``, ``page_in_sync``          the core: :class:`~.pages.PageMapper`'s
                                                                     frees, :class:`~.facts.DeviceFacts`
``pages``           ``map_granularity``                              the core: the page size on first use
``policy``          ``release_on_full_unload``                       nothing here: the residency manager reads it
=================== ================================================ ==============================================

A new platform quirk is one part (a module beside these, or a subclass of the part it changes) and one flag
in its group; :func:`choose_parts` is the one place that turns the flag into the part (``docs/backends.md``,
"A platform quirk of your own").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from ..._drivers.gpu import GpuDriver
from ...types import Capabilities
from .churn import ChurnWindowKeeper
from .descriptors import HandleDescriptors
from .devices import Devices
from .handles import HandleKeeper, RangeHeldHandles
from .pages import PageMapper
from .pool import ONE_POOL_SOURCES, OnePoolGuard, PoolBudget
from .selftest import VmmSelfTest
from .windows import FreshWindows, WindowBooks


@dataclass(frozen=True)
class Parts:
    """The parts one backend runs now (chosen again when its capabilities change), and its page mapper
    over them."""

    handles: HandleKeeper
    windows: FreshWindows
    one_pool: OnePoolGuard | None
    self_test: VmmSelfTest | None
    descriptors: HandleDescriptors | None
    pages: PageMapper


def choose_parts(capabilities: Capabilities, devices: Devices, budget: PoolBudget, books: WindowBooks,
                 room: Callable[[int, int], int], generations: Iterator[int]) -> Parts:
    """The parts for ``capabilities``, over the backend's ``devices``: ``budget`` reads its platform's budget
    source, ``books`` are its kept windows (they outlive the parts), ``room(index, total)`` is the headroom in
    force and ``generations`` numbers its pages."""
    caps = capabilities

    def driver() -> GpuDriver:
        return devices.driver

    handles = (HandleKeeper if caps.memory_returns_on_unmap else RangeHeldHandles)(caps, driver)
    windows = (FreshWindows(caps, driver, devices.address_held, books) if caps.reserve_churn_limit is None
               else ChurnWindowKeeper(caps, driver, devices.address_held, books, devices.name))
    every_device = caps.unified_pool or budget.source in ONE_POOL_SOURCES
    one_pool = OnePoolGuard(every_device, budget, room) if every_device or budget.source == "auto" else None
    self_test = VmmSelfTest(devices.name, devices.kind, driver) if caps.vmm_self_test else None
    descriptors = (HandleDescriptors(devices.name, driver, lambda: devices.states) if caps.handle_descriptors
                   else None)
    pages = PageMapper(caps, driver, devices.use, generations, handles, one_pool, descriptors)
    return Parts(handles, windows, one_pool, self_test, descriptors, pages)
