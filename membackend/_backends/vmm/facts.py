"""What the backend asks once about a device: whether it shares one pool with the host, and whether its frees
must synchronize it after fresh mappings (``page_in_sync``), from the machine facts or the process and driver."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from ..._drivers.gpu import GpuDriver
from ...types import Device, DriverError, Machine

log = logging.getLogger(__package__)  # the backend's one logger


class DeviceFacts:
    """The device facts of one backend (``name``, serving ``kind`` devices).

    ``machine`` (a function returning the :class:`~membackend.types.Machine`, asked once, on first need) says
    which devices run under WDDM; without it, or where it fails, this process's OS and the driver decide."""

    def __init__(self, name: str, kind: str, driver: Callable[[], GpuDriver],
                 machine: Callable[[], Machine] | None):
        self.name = name
        self.kind = kind
        self._driver = driver
        self._machine = machine
        self._machine_facts: Machine | None = None

    def integrated(self, index: int) -> bool:
        """Whether device ``index`` shares one pool with the host; a driver that cannot say: not known to."""
        try:
            return bool(self._driver().integrated(index))
        except DriverError:
            return False

    def syncs_page_ins(self, index: int, mode: str) -> bool:
        """Whether frees on device ``index`` synchronize it after fresh mappings, under ``page_in_sync`` ``mode``.

        ``wddm``: yes where the device runs under WDDM, whose video memory
        manager pages memory in asynchronously: on Windows, unless the driver
        model is TCC (every other Windows driver model, WDDM and MCDM, is served
        by VidMm). The facts come from the machine where one was given (a
        simulated profile's too), else from this process's OS and the driver.
        """
        if mode != "wddm":
            return mode == "always"
        os_name, model = self._os_and_driver_model(index)
        return os_name == "windows" and model != "tcc"

    def machine(self) -> Machine | None:
        """The machine facts (read once), or None where none were given or they could not be read."""
        if self._machine is not None and self._machine_facts is None:
            try:
                self._machine_facts = self._machine()
            except Exception as exc:  # the facts are advice: the process's own OS and driver decide instead
                log.warning("membackend: %s: machine facts unavailable (%s: %s); deciding from this process's OS "
                            "and driver", self.name, type(exc).__name__, exc)
                self._machine = None
        return self._machine_facts

    def _os_and_driver_model(self, index: int) -> tuple[str, str | None]:
        m = self.machine()
        if m is not None:
            info = next((i for i in m.devices if i.device == Device(self.kind, index)), None)
            if info is not None and info.driver_model is not None:
                return m.os, info.driver_model
            os_name = m.os
        else:
            os_name = "windows" if sys.platform == "win32" else sys.platform
        if os_name != "windows":
            return os_name, None
        try:
            return os_name, self._driver().driver_model(index, os_name)
        except (DriverError, NotImplementedError, TypeError):  # unknown: WDDM is what Windows runs
            return os_name, None
