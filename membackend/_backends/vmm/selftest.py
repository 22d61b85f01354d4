"""The VMM self-test, chosen by the capabilities' ``self_test`` group (``vmm_self_test``).

For drivers whose virtual-memory attribute alone was seen to be wrong (VMM on Strix Halo under WSL failed until
a ROCm fix): on each device's first use one page is reserved, created, mapped, given access, unmapped, released
and freed, and a failed step refuses the device with a ``DriverError`` naming it. The answer stands for the
device: a later use raises the same error without asking the driver again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..._drivers.gpu import GpuDriver
from ...types import DriverError

log = logging.getLogger(__package__)  # the backend's one logger


class VmmSelfTest:
    """The self-test of one backend (``name``, serving ``kind`` devices), run once per device."""

    def __init__(self, name: str, kind: str, driver: Callable[[], GpuDriver]):
        self.name = name
        self.kind = kind
        self._driver = driver
        self._failed: dict[int, DriverError] = {}  # per device whose self-test failed

    def check(self, index: int, page: int) -> None:
        """Raise the ``DriverError`` of device ``index``'s failed self-test (run with pages of ``page`` bytes
        on the first call for the device, remembered after)."""
        failed = self._failed.get(index)
        if failed is not None:  # tested once per device: the answer stands
            raise failed
        try:
            self._run(index, page)
        except DriverError as exc:
            self._failed[index] = exc
            raise

    def _run(self, index: int, page: int) -> None:
        """Reserve, create, map, set access, unmap, release and free one page of device ``index``; a failed
        step raises ``DriverError`` saying the device is not served (whatever was made is undone)."""
        d = self._driver()
        base = handle = None
        mapped = False
        try:
            base = d.address_reserve(page, page)
            handle = d.create(page, index)
            d.map(base, page, handle)
            mapped = True
            d.set_access(base, page, index)
            d.unmap(base, page)
            mapped = False
            d.release(handle)
            handle = None
            d.address_free(base, page)
            base = None
        except DriverError as exc:
            raise DriverError(exc.code, exc.call, f"the start-up self-test of virtual memory management on "
                                                  f"{self.kind}:{index} failed, so {self.name} does "
                                                  "not serve the device") from exc
        finally:  # what a failed step left: undone, newest first
            if mapped:
                self._undo_quietly(d.unmap, base, page)
            if handle is not None:
                self._undo_quietly(d.release, handle)
            if base is not None:
                self._undo_quietly(d.address_free, base, page)

    def _undo_quietly(self, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except DriverError:
            log.warning("membackend: %s: undoing the self-test's %s failed", self.name, call.__name__)
