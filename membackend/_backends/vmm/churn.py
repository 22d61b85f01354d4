"""The churn-window keeper: released large windows kept for reuse under a reserve-churn limit.

Chosen where the platform sets ``reserve_churn_limit`` (the capabilities' ``address_windows`` group; Windows
ROCm: large reserves fail once the process has freed enough large windows, rocm-systems #6191). A released
window of at least ``reserve_churn_window`` bytes is kept on its device and reused by the next large reserve it
holds. Frees of large windows are counted; the backend spends at most the limit minus :data:`CHURN_MARGIN` of
them (the *allowance*), on keeping each device's kept windows within its bound (at release: the smallest go,
the larger hold more models) and on trim (idle, unload of everything, close: every kept window goes back while
the allowance permits; when only some may go, the smallest go and the largest stay). The bound is the
platform's ``reserve_churn_keep`` windows per device (strict: large reservations alive count against the frees
they will need), or, where the platform sets none, :data:`KEPT_WINDOWS_PER_DEVICE` or more where the device had
more large reservations alive at once. The allowance *permits* a free when one is left and, after it, the frees
left still cover every device's large windows (alive and kept) past its bound; so the bound is kept by
construction: a fresh large reserve that could never be brought back within it is refused with
:class:`AddressWindowsExhausted` (a ``MemoryError``, so an out-of-memory, never a ``DriverError``), as is one the
driver itself refuses for want of memory (frees this backend did not see, e.g. another library in the process,
may have spent the limit). A fresh window after which no free would be left to spare is reserved as large as
the largest the device has served, so the windows that stay once the frees are spent hold every model the
device ran before (one at a time, under a bound of one). :meth:`ChurnWindowKeeper.kept_windows` reports the
windows, their bytes, the bound, the frees spent and why they stay (``membackend doctor`` prints it).
"""

from __future__ import annotations

import logging
from typing import Callable

from ..._drivers.gpu import GpuDriver
from ...platform import CHURN_MARGIN, KEPT_WINDOWS_PER_DEVICE
from ...types import AddressWindowsExhausted, Capabilities, Device, DriverError
from .windows import DeviceWindows, FreshWindows, KeptWindows, WindowBooks

log = logging.getLogger(__package__)  # the backend's one logger


class ChurnWindowKeeper(FreshWindows):
    """Large windows kept on release and reused, within the churn allowance (see the module docstring);
    small ones come and go as :class:`FreshWindows`. ``name`` is the backend's, for its messages."""

    keeps = True

    def __init__(self, capabilities: Capabilities, driver: Callable[[], GpuDriver], address_held: Callable[[], int],
                 books: WindowBooks, name: str):
        super().__init__(capabilities, driver, address_held, books)
        self.name = name
        self.limit = capabilities.reserve_churn_limit or 0

    # ------------------------------------------------------------------ reserve and release

    def window_for(self, device: Device, size: int, alignment: int) -> tuple[int, int]:
        if not self.is_large(size):
            return super().window_for(device, size, alignment)
        state = self._device(device.index)
        window = self._take_kept(state, size)
        if window is None:
            self.check_quota(device, size)
            self._check_window_bound(device, state, size)
            span = self._lasting_span(state, size)
            window = (self._reserve_large(device, state, span, alignment), span)
        state.large_alive += 1
        state.large_peak = max(state.large_peak, state.large_alive)
        state.largest = max(state.largest, window[1])
        return window

    def give_back(self, device: Device, base: int, size: int) -> None:
        if not self.is_large(size):
            return super().give_back(device, base, size)
        # kept for the next large reserve it holds: a free would spend one of the platform's large frees
        # (rocm-systems #6191); trim gives it back while frees are left
        state = self._device(device.index)
        state.windows.append((base, size))
        state.large_alive -= 1
        self._keep_within_bound(device, state)

    def free_window(self, base: int, size: int) -> None:
        super().free_window(base, size)
        if self.is_large(size):
            self.books.large_frees += 1

    def is_large(self, size: int) -> bool:
        return size >= self.capabilities.reserve_churn_window

    def _device(self, index: int) -> DeviceWindows:
        state = self.books.devices.get(index)
        if state is None:
            state = self.books.devices[index] = DeviceWindows(self.capabilities.reserve_churn_keep)
        return state

    @staticmethod
    def _take_kept(state: DeviceWindows, size: int) -> tuple[int, int] | None:
        """The smallest kept window that holds ``size`` bytes, taken out of the pool (large reserves only:
        a small one is reserved and freed at no cost to the churn limit)."""
        fits = [w for w in state.windows if w[1] >= size]
        if not fits:
            return None
        best = min(fits, key=lambda w: w[1])
        state.windows.remove(best)
        return best

    def _reserve_large(self, device: Device, state: DeviceWindows, size: int, alignment: int) -> int:
        """A fresh large address window. One the driver refuses for want of memory (the platform's limit reached
        by frees this backend did not see, or the system's commit limit: reservations are charged to commit) is
        out of memory, typed, with the driver's error as its cause; nothing is changed, so trim still gives
        kept windows back (G1)."""
        driver = self._driver()
        try:
            return driver.address_reserve(size, alignment)
        except DriverError as exc:
            if not driver.is_oom(exc):
                raise
            log.warning("membackend: %s: the driver refused a %d byte address window on %s (%s); answered as "
                        "out of memory", self.name, size, device, exc)
            raise self._refused(device, state, size,
                                f"the driver refused a large address window ({exc}), as the platform does once "
                                f"the process has spent its large frees") from exc

    def _lasting_span(self, state: DeviceWindows, size: int) -> int:
        """The bytes of a fresh large window of ``size``: ``size``, or the largest window the device has served
        when, with this window, no free is left to spare (the frees left only just cover every device's windows
        past its bound). Such a window may be one that stays once the frees are spent: sized so, it holds every
        model the device ran before, where one sized to a small model would leave the larger ones out of memory
        for the rest of the process. Never past the address quota (then ``size``)."""
        if state.largest <= size:
            return size
        if self._over_bound(state) < self._large_frees_left():
            return size
        quota = self.capabilities.address_quota
        if quota is not None and self.address_in_use() + 2 * state.largest > quota:
            return size
        return state.largest

    def _check_window_bound(self, device: Device, state: DeviceWindows, size: int) -> None:
        """Refuse a fresh large window that could never be given back within the devices' bounds: the
        frees left must cover every device's large windows past its bound (this one with the new window)."""
        if self._over_bound(state) > self._large_frees_left():
            raise self._refused(device, state, size, "a new large address window could never be given back: "
                                                     "the platform allows no more large frees")

    def _over_bound(self, state: DeviceWindows) -> int:
        """Every device's large windows past its bound, with one more alive on ``state``'s device."""
        return sum(s.over_bound(1 if s is state else 0) for s in self.books.devices.values())

    def _refused(self, device: Device, state: DeviceWindows, size: int, why: str) -> AddressWindowsExhausted:
        largest = max((w for _, w in state.windows), default=0)
        if state.large_alive:
            hint = f"unload a model on {device} and its window can be reused"
        else:
            hint = "every kept window is smaller; a larger one needs a new process"
        return AddressWindowsExhausted(
            f"reserving {size} bytes on {device}: {why} (large reserves fail after {self.limit} large frees, "
            f"rocm-systems #6191; {self.books.large_frees} of {self._large_frees_allowed()} allowed are spent) "
            f"and no kept window holds it ({len(state.windows)} kept, largest {largest} bytes; {state.large_alive} "
            f"large reservation(s) alive; at most {state.window_bound} stay kept); out of memory: {hint}")

    def _keep_within_bound(self, device: Device, state: DeviceWindows) -> None:
        """More windows kept than the device's bound: free the smallest (the larger hold more models) while
        the frees last; the bound check at reserve leaves enough of them (under a strict bound this is where a
        run of several large models on one device spends its frees). Never fails the release: a window whose
        free fails stays kept (trim tries it again)."""
        while len(state.windows) > state.window_bound and self._large_frees_left() > 0:
            smallest = min(state.windows, key=lambda w: w[1])
            try:
                self.free_window(*smallest)
            except DriverError as exc:
                log.warning("membackend: %s: freeing a kept address window on %s failed (%s); it stays kept",
                            self.name, device, exc)
                return
            state.windows.remove(smallest)

    # ------------------------------------------------------------------ the allowance, trim and the report

    def _large_frees_allowed(self) -> int:
        """Large frees this backend may spend: the platform's limit minus :data:`CHURN_MARGIN`."""
        return max(0, self.limit - CHURN_MARGIN)

    def _large_frees_left(self) -> int:
        return max(0, self._large_frees_allowed() - self.books.large_frees)

    def _trim_plan(self, state: DeviceWindows) -> list[tuple[int, int]]:
        """The kept windows of ``state`` (all large: only those are kept) a trim now frees, in the order it
        frees them: smallest first, each while the churn allowance permits it -- a large free is left and,
        after it, the frees left still cover the large windows past their bounds on every device (see
        :meth:`_check_window_bound`). Asks no driver and changes nothing: :meth:`trim` frees this plan,
        :meth:`kept_windows` counts it."""
        left = self._large_frees_left()
        others = sum(s.over_bound() for s in self.books.devices.values() if s is not state)
        plan: list[tuple[int, int]] = []
        for window in sorted(state.windows, key=lambda w: w[1]):
            if left < 1 or others + state.over_bound(fewer_kept=len(plan) + 1) > left - 1:
                break
            left -= 1
            plan.append(window)
        return plan

    def trim(self, device: Device) -> int:
        """Free the kept windows of ``device`` the churn allowance permits (:meth:`_trim_plan`); what stays
        is said (a warning once per backend, then at debug level). Returns the bytes freed."""
        state = self.books.devices.get(device.index)
        if state is None:
            return 0
        released = 0
        for window in self._trim_plan(state):
            self.free_window(*window)
            state.windows.remove(window)
            released += window[1]
        if state.windows:  # what the churn allowance does not permit freeing stays, and is said
            report = log.debug if self.books.warned else log.warning
            self.books.warned = True  # once per backend: unload-everything cycles would repeat it
            report("membackend: %s", self.kept_windows(device).describe())
        return released

    def kept_windows(self, device: Device) -> KeptWindows:
        """What stays reserved on ``device`` after its reservations were released, and why. Asks no driver."""
        state = self.books.devices.get(device.index)
        windows = state.windows if state is not None else []
        give_back = len(self._trim_plan(state)) if state is not None else 0
        keep = self.capabilities.reserve_churn_keep
        if keep is not None:
            rule = f"the platform's bound: {keep} per device"
        else:
            peak = state.large_peak if state is not None else 0
            rule = (f"{KEPT_WINDOWS_PER_DEVICE} per device, or as many large reservations as the device had alive "
                    f"at once ({peak})")
        return KeptWindows(
            device=device, windows=len(windows), bytes=sum(size for _, size in windows),
            largest=max((size for _, size in windows), default=0),
            bound=state.window_bound if state is not None else (keep or KEPT_WINDOWS_PER_DEVICE),
            large_frees_spent=self.books.large_frees, large_frees_allowed=self._large_frees_allowed(),
            churn_limit=self.limit, can_give_back=give_back > 0,
            give_back=give_back, bound_rule=rule, reason=self._reason(len(windows), give_back))

    def _reason(self, windows: int, give_back: int) -> str:
        """Why ``windows`` kept windows stay, ``give_back`` of them going at the next trim, in words."""
        left = self._large_frees_left()
        trim = "the next trim (idle, unload of everything, close)"
        if not windows:
            return "none kept"
        if give_back == windows:
            return (f"kept for reuse by the next large reserve, which then spends no large free; {trim} gives "
                    f"them back: the churn allowance permits it")
        if left < 1:
            return (f"they stay: the platform allows no more large frees ({self.books.large_frees} of "
                    f"{self._large_frees_allowed()} spent); reusing them spends none")
        if give_back:
            return (f"{trim} gives {give_back} back, the smallest; the rest stay: the churn allowance permits "
                    f"no more ({left} large free(s) left, held to bring every device within its bound)")
        return (f"they stay: the {left} large free(s) left are held to bring the large windows past the "
                f"devices' bounds back within them")
