"""Contexts: the devices by index, the current device per host thread, CUDA's primary contexts, start-up
(``cuInit`` / ``hipInit``) and fault injection.

Where a behaviour comes from:

* The current device is per host thread: CUDA driver API reference,
  ``cuCtxSetCurrent`` ("binds the specified CUDA context to the calling CPU
  thread") and ``cuCtxGetCurrent`` (NULL and CUDA_SUCCESS when none is bound);
  HIP runtime API, ``hipSetDevice`` ("the default device for the calling host
  thread"; 0 until set). A primary context is reference counted:
  ``cuDevicePrimaryCtxRetain`` / ``cuDevicePrimaryCtxRelease`` (releasing one
  that is not retained is CUDA_ERROR_INVALID_CONTEXT).
* Operations on a device that is not current: TheRock #6224.
"""

from __future__ import annotations

import threading

from .faults import FaultPlan
from .state import SimDevice, SimError, SimState, locked

__all__ = ["Contexts"]


class Contexts:
    """The per-thread current device and context over ``state``'s devices; ``faults`` fails calls on demand.

    CUDA contexts: one primary context per device, handle = index + 1 (0 is NULL)."""

    def __init__(self, state: SimState, faults: FaultPlan):
        self.lock = state.lock
        self._devices = state.devices
        self._profile = state.profile
        self.faults = faults
        self._current = threading.local()  # per thread: .device (HIP's, or the CUDA context's) and .ctx
        self.initialized = False

    def current(self) -> int:
        """The calling thread's current device: HIP's (0 until set), or the device of the CUDA
        context bound to the thread."""
        return getattr(self._current, "device", 0)

    def set_current(self, device: int) -> None:
        """``hipSetDevice``: the calling thread's device."""
        self.device(device)
        self._current.device = device

    def current_context(self) -> int:
        """``cuCtxGetCurrent``: the context bound to the calling thread, 0 (NULL) when none is."""
        return getattr(self._current, "ctx", 0)

    def set_current_context(self, ctx: int) -> None:
        """``cuCtxSetCurrent``: bind ``ctx`` (0 unbinds) to the calling thread."""
        if ctx:
            self.device(ctx - 1)
            self._current.device = ctx - 1
        self._current.ctx = ctx

    def require_context(self) -> None:
        """Calls whose documented errors include CUDA_ERROR_INVALID_CONTEXT need a bound context."""
        if not self.current_context():
            raise SimError("invalid_context", "no CUDA context is current on this thread")

    @locked
    def primary_retain(self, device: int) -> int:
        d = self.device(device)
        d.primary_refs += 1
        return device + 1

    @locked
    def primary_release(self, device: int) -> None:
        d = self.device(device)
        if d.primary_refs <= 0:
            raise SimError("invalid_context", f"the primary context of device {device} is not retained")
        d.primary_refs -= 1

    def device(self, index: int) -> SimDevice:
        """The device at ``index``; ``SimError("invalid_device")`` for any other value."""
        if not isinstance(index, int) or not 0 <= index < len(self._devices):
            raise SimError("invalid_device", f"no device {index}")
        return self._devices[index]

    def check_current(self, device: int, what: str) -> None:
        """``SimError("invalid_device")`` where the profile's driver checks that ``what`` (on ``device``)
        belongs to the current device and it does not."""
        if self._profile.current_device_checked and device != self.current():
            raise SimError("invalid_device",
                           f"{what} belongs to device {device} but device {self.current()} is current")

    @locked
    def inject(self, call: str) -> None:
        code = self.faults.check(call)
        if code is not None:
            raise SimError("injected", f"{call} failed by fault injection", code)

    @locked
    def init(self) -> None:
        self.inject("init")
        self.initialized = True
