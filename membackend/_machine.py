"""Hardware facts, gathered once and cheaply, from the drivers' own discovery.

:func:`gather_machine` returns this machine's :class:`~membackend.types.Machine`:
OS, CPUs, the torch build (from its installed metadata, torch is never
imported), RAM and the cgroup limit (read at each call), and the GPUs as the
CUDA driver API, NVML, the HIP runtime (hip-python or the ctypes binding of
torch's ROCm runtime) and, for names only, ``/proc/driver/nvidia`` list them,
before torch and without creating a context (see
:mod:`membackend._drivers.discovery` for every call made). Every fact carries
its source (``Machine.source_of``, ``DeviceInfo.source_of``); a driver that
fails lists no device and says why in ``Machine.discovery``. Nothing here
raises for a missing or broken driver.

Every fact can be overridden from :class:`~membackend._settings.MachineOverrides`
(``MEMBACKEND_MACHINE__*``): the user's explicit word, applied last and
sourced as such. A simulated machine (``MEMBACKEND_SIM_PROFILE``) is
discovered through its simulated driver by
:func:`membackend._drivers.open.machine_for`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._drivers.discovery import torch_build
from ._drivers.open import gather, refresh
from .types import Machine

if TYPE_CHECKING:  # naming the pydantic model at import would build it: start-up stays free of pydantic
    from ._settings import MachineOverrides

__all__ = ["gather_machine", "torch_build", "refresh"]


def gather_machine(overrides: MachineOverrides | None = None) -> Machine:
    """This machine, discovered once per process through the real drivers (RAM figures read now),
    with ``overrides`` applied. Never raises for a driver that is missing or fails."""
    return gather(overrides)
