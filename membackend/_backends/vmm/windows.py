"""Where a reservation's address window comes from and where it goes: fresh from the driver, back to it.

Chosen by the capabilities' ``address_windows`` group (``Capabilities.GROUPS``):

* :class:`FreshWindows` (every platform): each reserve asks the driver for a window and each release frees
  it; under an ``address_quota`` a reserve that would pass it is refused up front with
  ``AddressSpaceExhausted`` (a ``MemoryError``) instead of letting the driver crash (rocm-systems #9823); a
  window the driver refuses for want of memory (its address space is full: ``cuMemAddressReserve``'s
  ``CUDA_ERROR_OUT_OF_MEMORY``, ``hipMemAddressReserve``'s ``hipErrorOutOfMemory``) is the same typed
  out-of-memory, never a ``DriverError``, so the residency manager unloads idle models and tries again;
* :class:`~.churn.ChurnWindowKeeper` (a ``reserve_churn_limit``, Windows ROCm): large windows are kept on
  release and reused; its books (:class:`WindowBooks`) and its report (:class:`KeptWindows`) are here.

Called under the backend's lock, with the device current.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..._drivers.gpu import GpuDriver
from ...platform import KEPT_WINDOWS_PER_DEVICE
from ...types import AddressSpaceExhausted, Capabilities, Device, DriverError, format_size


@dataclass(frozen=True)
class KeptWindows:
    """What a backend under a reserve-churn limit keeps reserved on one device after release.

    ``windows``/``bytes``: released address windows kept for reuse (charged to
    the process's commit on Windows ROCm), ``largest`` the largest of them;
    ``bound``: the most that stay kept on the device once no large free is
    left (the platform's ``reserve_churn_keep``; where it sets none,
    :data:`KEPT_WINDOWS_PER_DEVICE` or the most large reservations the device
    had alive at once), ``bound_rule`` how it is set, in words;
    ``large_frees_spent`` of ``large_frees_allowed`` (the platform's
    ``churn_limit`` minus :data:`CHURN_MARGIN`), process-wide for this backend
    (frees made by other code in the process are not seen);
    ``give_back``: how many of the windows a trim now would free (the churn
    allowance permitting), ``can_give_back`` whether it is any;
    ``reason``: why the windows are kept, in words (for the doctor, the
    status and logs). Figures of one moment, taken under the backend's lock.
    """

    device: Device
    windows: int
    bytes: int
    largest: int
    bound: int
    large_frees_spent: int
    large_frees_allowed: int
    churn_limit: int
    can_give_back: bool
    give_back: int = 0
    bound_rule: str = ""
    reason: str = ""

    def describe(self) -> str:
        """One line for the doctor and logs."""
        if not self.windows:
            kept = "no address window kept"
        else:
            kept = f"{self.windows} address window(s) kept, {format_size(self.bytes)} ({self.reason})"
        return (f"{self.device}: {kept}; at most {self.bound} stay once no large free is left ({self.bound_rule}); "
                f"large frees {self.large_frees_spent} of {self.large_frees_allowed} spent (large reserves fail "
                f"after {self.churn_limit}, rocm-systems #6191)")


class DeviceWindows:
    """One device's large windows under a reserve-churn limit: those kept after release, and the counts of
    those alive that bound how many stay."""

    __slots__ = ("windows", "large_alive", "large_peak", "largest", "keep")

    def __init__(self, keep: int | None):
        self.windows: list[tuple[int, int]] = []  # (base, size) of released large windows kept for reuse
        self.large_alive = 0  # live reservations on large windows
        self.large_peak = 0  # the most of those alive at once
        self.largest = 0  # the largest large window this device has served
        self.keep = keep  # the platform's strict bound (reserve_churn_keep); None: the peak rule

    @property
    def pooled(self) -> int:
        return sum(size for _, size in self.windows)

    @property
    def window_bound(self) -> int:
        """The most kept windows this device holds once no large free is left."""
        if self.keep is not None:
            return self.keep
        return max(KEPT_WINDOWS_PER_DEVICE, self.large_peak)

    def over_bound(self, more_alive: int = 0, fewer_kept: int = 0) -> int:
        """Large windows (alive and kept) past the bound, with ``more_alive`` more reservations alive and
        ``fewer_kept`` fewer windows kept: the frees it takes to bring the device back within its bound once
        every reservation is released. Under the platform's strict bound every large window counts; under
        the peak rule the ones alive never do (the bound grows to them)."""
        alive = self.large_alive + more_alive
        ceiling = self.keep if self.keep is not None else max(KEPT_WINDOWS_PER_DEVICE, self.large_peak, alive)
        return max(0, alive + len(self.windows) - fewer_kept - ceiling)


@dataclass
class WindowBooks:
    """The kept windows of every device and the large frees spent, process-wide for one backend: they outlive
    a change of the backend's capabilities (the parts are chosen again, the books stay)."""

    devices: dict[int, DeviceWindows] = field(default_factory=dict)
    large_frees: int = 0  # frees of windows >= reserve_churn_window (what rocm-systems #6191 counts)
    warned: bool = False  # windows that trim could not give back were said once (then at debug level)


class FreshWindows:
    """Every window fresh from the driver and freed on release; a reserve past ``address_quota`` refused.

    ``address_held()`` is the address space the backend's devices hold besides kept windows (reservations and
    resident pages), which the quota counts with the windows ``books`` keep (none, unless a churn-window
    keeper kept some before the backend's capabilities changed)."""

    keeps = False  # whether released windows are kept (:meth:`kept_windows` reports them)

    def __init__(self, capabilities: Capabilities, driver: Callable[[], GpuDriver], address_held: Callable[[], int],
                 books: WindowBooks):
        self.capabilities = capabilities
        self._driver = driver
        self._address_held = address_held
        self.books = books

    def window_for(self, device: Device, size: int, alignment: int) -> tuple[int, int]:
        """``(base, bytes)`` of an address window of at least ``size`` bytes for a new reservation on
        ``device``. Raises ``AddressSpaceExhausted`` past the quota and where the driver has no window of the
        size left (its out-of-memory answer, the cause), ``DriverError`` for any other failure of the driver.
        Nothing is reserved when it raises."""
        self.check_quota(device, size)
        driver = self._driver()
        try:
            return driver.address_reserve(size, alignment), size
        except DriverError as exc:
            # out of address space is out of memory (CUDA driver API reference, cuMemAddressReserve:
            # CUDA_ERROR_OUT_OF_MEMORY; ROCm clr hip_vm.cpp, hipMemAddressReserve: hipErrorOutOfMemory when
            # no range is found): typed, so the policy unloads idle models to make room (ComfyUI #12763)
            if not driver.is_oom(exc):
                raise
            raise AddressSpaceExhausted(
                f"reserving {format_size(size)} on {device}: the driver has no address range of that size left "
                f"({exc}); accepted: a smaller reservation, or unload a model first") from exc

    def give_back(self, device: Device, base: int, size: int) -> None:
        """The window of a released reservation: freed (raises the driver's ``DriverError``)."""
        self.free_window(base, size)

    def free_window(self, base: int, size: int) -> None:
        self._driver().address_free(base, size)

    def trim(self, device: Device) -> int:
        """Free what the device keeps of released windows; returns the bytes (none freed here: 0)."""
        return 0

    def pooled(self, index: int) -> int:
        """Bytes of released windows device ``index`` keeps."""
        state = self.books.devices.get(index)
        return state.pooled if state is not None else 0

    def kept_windows(self, device: Device) -> KeptWindows | None:
        """The report of :meth:`~.backend.VmmBackend.kept_windows`: None, nothing is kept."""
        return None

    def address_in_use(self) -> int:
        """Address space every device holds: reservations, resident pages and kept windows."""
        return self._address_held() + self.pooled_total()

    def pooled_total(self) -> int:
        """Bytes of released windows every device keeps."""
        return sum(state.pooled for state in self.books.devices.values())

    def check_quota(self, device: Device, rounded: int) -> None:
        quota = self.capabilities.address_quota
        if quota is None:
            return
        in_use = self.address_in_use()
        if in_use + 2 * rounded > quota:  # the range and, at worst, its mappings
            raise AddressSpaceExhausted(
                f"reserving {rounded} bytes on {device} would pass the {quota} byte GPU address quota "
                f"({in_use} in use); unload a model first")
