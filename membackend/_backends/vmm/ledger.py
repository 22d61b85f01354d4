"""What a device holds for the backend, as ``membackend_inspect`` reports it.

A simulated driver keeps its own tables (:func:`driver_tables`): ``reserved``/``resident`` are its figures, and
kept windows (reserved in the driver, no reservation's) and unmapped physical handles are ``held``. A real CUDA
or HIP driver keeps no table a process can read, so the figures come from the backend's own handle ledger
(:class:`HandleLedger`), checked against the driver's free figure: ``committed`` is the device memory of the
handles it created and has not released (mapped, and kept for reuse), ``held`` the kept handles and kept
windows. ``source`` says which, and where the driver's free figure cannot account for the committed bytes it
says so (how many) instead of vouching for them. On Windows ``committed`` is None: there the platform charges
the process's private commit, which the ledger cannot split out (callers measure it themselves).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ..._drivers.gpu import GpuDriver
from ...types import Device, DriverError, DriverState, format_size


@dataclass(frozen=True)
class HandleLedger:
    """What one device holds for a :class:`VmmBackend`, from its own handle ledger, checked against the driver.

    A real CUDA or HIP driver keeps no table a process can read (the simulated drivers do), so the backend
    counts what it made: ``reserved``, the address space of its live reservations (whole windows);
    ``resident``, the bytes of physical handles mapped into them; ``kept``, the bytes of handles it created,
    unmapped and still holds for reuse (recycled with the device, or kept with a live range where memory
    returns only when the range is freed); ``windows``, released address windows kept for reuse (address
    space, no memory). ``committed`` (``resident + kept``) is device memory the driver must count as used;
    ``held`` (``kept + windows``) is what a trim gives back.

    **The check is one-sided.** ``total`` and ``free`` are the driver's own figures for the whole device
    (``source`` names the call): every process's use, this one's context and its runtime allocator (torch's
    cache) included. So the driver's ``total - free`` is at least ``committed`` when the ledger is true;
    more is normal and says nothing. Less, by more than ``granularity`` (the driver's rounding), is
    what the driver cannot account for: ``unaccounted`` bytes, and :meth:`state` says so instead of
    vouching for the ledger. Causes: handles the driver never charged to the device (an APU whose free
    figure is its host's, above its own total; WDDM demoting video memory to system memory), or a
    ledger that counts handles already gone. Nothing is checked when the ledger holds no memory, or the
    query failed (``note`` says why)."""

    device: Device
    reserved: int
    resident: int
    kept: int
    windows: int
    granularity: int
    total: int | None
    free: int | None
    source: str
    unaccounted: int
    note: str = ""

    @classmethod
    def checked(cls, device: Device, reserved: int, resident: int, kept: int, windows: int, granularity: int,
                total: int, free: int, source: str) -> "HandleLedger":
        """The ledger's figures checked against the driver's ``total`` and ``free`` (see the class)."""
        committed = resident + kept
        in_use = max(0, total - free)  # an APU may report free above its own total: nothing in use then
        short = committed - in_use
        unaccounted = short if short > granularity else 0
        if unaccounted:
            note = (f"{source} cannot account for {format_size(unaccounted)} of the {format_size(committed)} "
                    f"committed: the device has {format_size(in_use)} in use, every process included")
        else:
            note = f"{source}: {format_size(in_use)} in use on the device, every process included, holds it"
        return cls(device, reserved, resident, kept, windows, granularity, total, free, source, unaccounted, note)

    @classmethod
    def asking(cls, driver: GpuDriver, device: Device, reserved: int, resident: int, kept: int, windows: int,
               granularity: int) -> "HandleLedger":
        """The ledger's figures, checked against the driver's mem-get-info of ``device`` where it holds memory
        (one call; a failed one leaves the check unmade, with the driver's error as the reason)."""
        if resident + kept == 0:
            return cls(device, reserved, resident, kept, windows, granularity, None, None, "", 0,
                       "no physical memory held: nothing to check")
        call = "cuMemGetInfo" if driver.vendor == "cuda" else "hipMemGetInfo"
        try:
            total, free, label = driver.budget("device", device.index)
        except DriverError as exc:
            return cls(device, reserved, resident, kept, windows, granularity, None, None, call, 0,
                       f"not checked: {exc}")
        return cls.checked(device, reserved, resident, kept, windows, granularity, total, free, label)

    @property
    def committed(self) -> int:
        return self.resident + self.kept

    @property
    def held(self) -> int:
        return self.kept + self.windows

    def state(self) -> DriverState:
        """The :class:`DriverState` ``membackend_inspect`` returns: the ledger's figures, the check in ``source``
        (``committed`` None on Windows, where the platform charges the process's private commit)."""
        return DriverState(reserved=self.reserved, resident=self.resident, held=self.held,
                           source=f"membackend's handle ledger ({self.note})",
                           committed=None if sys.platform == "win32" else self.committed)


def driver_tables(raw: dict[str, Any], windows: int, label: str) -> DriverState:
    """The :class:`DriverState` of a driver that keeps its own tables (``raw``, from ``GpuDriver.inspect``):
    kept ``windows`` (bytes reserved in the driver, no reservation's) and unmapped physical handles are
    ``held``."""
    return DriverState(reserved=raw["reserved"] - windows, resident=raw["mapped"],
                       held=windows + raw["physical"] - raw["mapped"], source=f"driver tables ({label})",
                       committed=raw.get("committed"), hazards=raw.get("hazards", 0), calls=raw.get("calls"))
