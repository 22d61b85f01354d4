"""Simulated CUDA and HIP drivers, so every GPU code path runs without a GPU.

``sim_driver("wddm-6gb")`` returns a :class:`~membackend.drivers.cuda.CudaDriver`
(or ``HipDriver``) wrapping a simulated module over a fresh
:class:`SimPlatform`; ``driver.sim`` is that platform, for tests to inspect,
advance its clock or inject faults.
"""

from __future__ import annotations

from ..gpu import GpuDriver
from .platform import FaultPlan, FaultRule, SimError, SimPlatform, SimulatedBugcheck, SimulatedCrash
from .profiles import PROFILES, Profile, SimDeviceSpec, get_profile

__all__ = ["sim_driver", "SimPlatform", "FaultPlan", "FaultRule", "SimError", "SimulatedBugcheck",
           "SimulatedCrash", "PROFILES", "Profile", "SimDeviceSpec", "get_profile"]


def sim_driver(profile: str | Profile, faults: FaultPlan | None = None) -> GpuDriver:
    """A driver wrapper over a new simulated machine of ``profile``."""
    platform = SimPlatform(profile, faults)
    if platform.profile.vendor == "hip":
        from ..hip import HipDriver
        from .hip import SimHipModule

        return HipDriver(SimHipModule(platform))
    from ..cuda import CudaDriver
    from .cuda import SimCudaDriverModule

    return CudaDriver(SimCudaDriverModule(platform))
