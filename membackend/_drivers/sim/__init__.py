"""Simulated CUDA and HIP drivers, so every GPU code path runs without a GPU.

``sim_driver("wddm-6gb")`` returns a :class:`SimCudaDriver` (or
:class:`SimHipDriver`): the real driver wrapper class over a simulated module
with cuda-python's (hip-python's) names, over a fresh :class:`SimPlatform`.
It adds what only a simulation can offer — ``sim`` (the platform, for tests
to inspect, advance its clock or inject faults), :meth:`inspect` (the
driver's own tables) and :meth:`inject_failures` — and answers the budget
sources from its model of the platform (the simulated twins of DXGI and
``MemAvailable``). :class:`SimHost` is the simulated host around it (OS,
torch build, ``/proc/meminfo``), so machine discovery runs its real code on a
profile. Only :mod:`membackend._drivers.open` imports this package.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..._hostmem import HostMemory
from ...types import SIM_SOURCE, DriverError
from ..cuda import CudaDriver
from ..discovery import torch_vendor_of
from ..gpu import GpuDriver
from ..hip import HipDriver
from .platform import FaultPlan, FaultRule, SimError, SimPlatform, SimulatedBugcheck, SimulatedCrash
from .profiles import PROFILES, Profile, SimDeviceSpec, get_profile

__all__ = ["sim_driver", "SimHost", "SimCudaDriver", "SimHipDriver", "SimPlatform", "FaultPlan", "FaultRule", "SimError",
           "SimulatedBugcheck", "SimulatedCrash", "PROFILES", "Profile", "SimDeviceSpec", "get_profile",
           "SIM_ERRORS"]

#: per simulated API: the VMM calls that random failure injection fails, and the code each returns
#: (an out-of-memory code where the real call can run out of memory, else invalid-value/not-ready)
SIM_ERRORS = {
    "cuda": {"cuMemCreate": 2, "cuMemMap": 719, "cuMemSetAccess": 600, "cuMemUnmap": 1, "cuMemRelease": 1,
             "cuMemAddressReserve": 2, "cuMemAddressFree": 1, "cuCtxSynchronize": 719},
    "hip": {"hipMemCreate": 2, "hipMemMap": 1, "hipMemSetAccess": 600, "hipMemUnmap": 1, "hipMemRelease": 1,
            "hipMemAddressReserve": 2, "hipMemAddressFree": 1, "hipDeviceSynchronize": 1},
}


class SimInjection:
    """Random failures of the simulated VMM calls until :meth:`stop` (a ``FailureInjection``)."""

    def __init__(self, sim: SimPlatform, probability: float, seed: int):
        self._sim = sim
        self._rules = [sim.faults.add(call, code, probability=probability)
                       for call, code in SIM_ERRORS[sim.profile.vendor].items()]
        sim.faults.rng.seed(seed)
        self._before = sim.faults.injected
        self._stopped: int | None = None

    @property
    def injected(self) -> int:
        return self._stopped if self._stopped is not None else self._sim.faults.injected - self._before

    def stop(self) -> None:
        if self._stopped is None:
            self._stopped = self.injected
            for rule in self._rules:
                self._sim.faults.rules.remove(rule)


class _Simulated(GpuDriver):
    """What a simulated driver adds to the real wrapper (mixed in before it)."""

    sim: SimPlatform
    simulated = True

    @property
    def cpu_addressable(self) -> bool:
        """The simulated device's bytes are memory of this process, at the same addresses (unless the
        operating system could not back them: ``sim.memory.reason`` says why)."""
        return self.sim.memory.backed

    def memory_note(self) -> str | None:
        return f"device memory: {self.sim.memory.reason}"

    def open_descriptors(self) -> int | None:
        """The process's descriptors, with those the simulated runtime holds without taking real ones (ROCm
        7.14: one per live handle, ``SimPlatform.descriptors_held``)."""
        real = super().open_descriptors()
        return None if real is None else real + self.sim.descriptors_held()

    def budget(self, source: str, index: int) -> tuple[int, int, str]:
        sim = self.sim
        if source == "wddm":  # DXGI's budget and this process's usage of the device
            if sim.profile.os != "windows":  # as the real query does off Windows (dxgi.query_video_memory)
                raise DriverError("unavailable", "IDXGIAdapter3::QueryVideoMemoryInfo",
                                  f"DXGI exists only on Windows; the simulated {sim.profile.name} runs "
                                  f"{sim.profile.os}")
            budget = sim.wddm_budget(index)
            used = sim.state(index)["physical"] + sim.process_bytes(index)  # the process's usage: all of it
            return budget, max(0, budget - used), f"DXGI QueryVideoMemoryInfo budget ({self.label})"
        if source == "unified":  # /proc/meminfo of the one pool
            info = sim.meminfo()
            return info["MemTotal"], info["MemAvailable"], f"unified pool: MemAvailable ({self.label})"
        return super().budget(source, index)

    def host_ram(self) -> tuple[int, int]:
        """The simulated host's MemTotal and MemAvailable (the ``apu`` source's third figure)."""
        info = self.sim.meminfo()
        return info["MemTotal"], info["MemAvailable"]

    def amdgpu_memory(self, index: int) -> Any:
        """The simulated amdgpu driver's sysfs memory files (HIP profiles only: no other driver writes them)."""
        from ..apu import AmdgpuMemory

        if self.vendor != "hip":
            return None
        f = self.sim.amdgpu_sysfs(index)
        domain, bus, dev = self.sim.pci_location(index)
        return AmdgpuMemory(f["vram_total"], f["vram_used"], f["gtt_total"], f["gtt_used"],
                            path=f"simulated /sys/bus/pci/devices/{domain:04x}:{bus:02x}:{dev:02x}.0 ({self.label})")

    def inspect(self, index: int) -> dict[str, Any]:
        st = self.sim.state(index)
        return {"reserved": st["reserved"], "mapped": st["mapped"], "physical": st["physical"],
                "committed": self._committed(),
                "hazards": self.sim.use_after_free + self.sim.bugchecks + self.sim.crashes + self.sim.illegal_addresses,
                "calls": dict(self.sim.faults.calls)}

    def _committed(self) -> int | None:
        """What the platform charges the process, where it charges more than the resident pages: Windows
        ROCm's private commit (reservations count), or ROCm 7.2's device memory, where released pages stay
        charged until their range is freed; None elsewhere."""
        p = self.sim.profile
        if p.private_commit_reservations:
            return self.sim.private_commit
        if p.memory_held_until_address_free:  # the VMM handles' memory; the process's own allocations apart
            return sum(d.used - d.process for d in self.sim.devices)
        return None

    def inject_failures(self, probability: float, seed: int) -> SimInjection:
        return SimInjection(self.sim, probability, seed)

    def close(self) -> None:
        """Release what the wrapper retained (CUDA: the primary contexts), then the simulated device memory's
        file descriptor if nothing holds a range of it any more (as after a session released everything): at
        once, not when the simulation is collected. The driver may be used again; it opens a new one then."""
        try:
            super().close()
        finally:
            self.sim.shed_memory()


class SimCudaDriver(_Simulated, CudaDriver):
    """:class:`CudaDriver` over a simulated ``cuda.bindings.driver``."""

    def __init__(self, platform: SimPlatform):
        from .cuda import SimCudaDriverModule

        self.sim = platform
        super().__init__(SimCudaDriverModule(platform))


class SimHipDriver(_Simulated, HipDriver):
    """:class:`HipDriver` over a simulated ``hip.hip``."""

    def __init__(self, platform: SimPlatform):
        from .hip import SimHipModule

        self.sim = platform
        super().__init__(SimHipModule(platform))


def sim_driver(profile: str | Profile, faults: FaultPlan | None = None,
               environ: Mapping[str, str] | None = None, hold_bytes: bool = True) -> Any:
    """A driver wrapper over a new simulated machine of ``profile``; ``environ`` is the environment
    its driver reads (``CUDA_VISIBLE_DEVICES``...), empty by default; ``hold_bytes=False`` keeps books only
    (a replay of a machine larger than this one)."""
    platform = SimPlatform(profile, faults, environ, hold_bytes=hold_bytes)
    return (SimHipDriver if platform.profile.vendor == "hip" else SimCudaDriver)(platform)


class SimHost:
    """The host of a simulated machine, answering what discovery asks a real one: the OS name
    (``platform.system()``), the installed torch build (its version string, parsed by the real
    :func:`~membackend._drivers.discovery.torch_vendor_of`) and ``/proc/meminfo`` of a fresh process
    on the profile (:meth:`SimPlatform.meminfo`). CPUs are this machine's: no profile models them."""

    def __init__(self, profile: str | Profile):
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.label = f"{SIM_SOURCE}{self.profile.name}"

    def os_name(self) -> tuple[str, str]:
        return self.profile.os, f"{self.label}: the simulated OS"

    def cpus(self) -> tuple[int, str]:
        return os.cpu_count() or 1, "os.cpu_count() (not simulated)"

    def torch(self) -> tuple[str | None, str | None, str]:
        version = self.profile.torch or None
        return version, torch_vendor_of(version) if version else None, f"{self.label}: the simulated torch build"

    def memory(self) -> HostMemory:
        info = SimPlatform(self.profile, hold_bytes=False).meminfo()
        return HostMemory(total=info["MemTotal"], available=info["MemAvailable"],
                          source=f"MemAvailable ({self.label})", ram_total=info["MemTotal"],
                          ram_available=info["MemAvailable"], cgroup_limit=None)
