"""The one place that picks a real or a simulated driver.

Settings, machine facts and backends know nothing of the simulation: they ask
here. With ``sim_profile`` set (``MEMBACKEND_SIM_PROFILE=<profile>``) GPU
drivers are simulated twins of the profile's platform and the machine facts
follow the profile; without it the real cuda-python / hip-python wrappers are
used. Profile names are validated here, where the simulation lives.
"""

from __future__ import annotations

from typing import Any

from ..machine import gather_machine, torch_build
from ..types import ConfigError, Machine
from .gpu import GpuDriver

__all__ = ["profile_names", "check_sim_profile", "machine_for", "resolve_vendor", "bindings_missing",
           "open_gpu_driver", "open_sim_variant", "simulated_failures", "LazyDriver"]

VENDORS = ("cuda", "hip")


def profile_names() -> tuple[str, ...]:
    """The simulated platforms ``sim_profile`` accepts."""
    from .sim.profiles import PROFILES

    return tuple(PROFILES)


def check_sim_profile(name: str | None) -> None:
    """Raise ``ConfigError`` (key ``sim_profile``) when ``name`` is set and not a known profile."""
    if name is not None and name not in profile_names():
        raise ConfigError("sim_profile", "MEMBACKEND_SIM_PROFILE or settings",
                          f"unknown simulation profile {name!r}", ", ".join(profile_names()))


def machine_for(settings: Any) -> Machine:
    """The machine the settings describe: detected, then the simulated profile's facts, then overrides."""
    overrides = settings.machine
    if settings.sim_profile:
        from ..settings import MachineOverrides
        from .sim.profiles import get_profile

        check_sim_profile(settings.sim_profile)
        merged = {**get_profile(settings.sim_profile).machine_overrides(), **overrides.model_dump(exclude_none=True)}
        overrides = MachineOverrides(**merged)
    return gather_machine(overrides)


def resolve_vendor(vendor: str | None, settings: Any) -> str:
    """A platform's vendor; None (the generic platform) means the vendor of this machine's torch
    build or simulated profile: ``hip`` for ROCm, else ``cuda``."""
    if vendor is not None:
        if vendor not in VENDORS:
            raise ConfigError("vendor", "platform", f"unknown vendor {vendor!r}", ", ".join(VENDORS))
        return vendor
    if settings.sim_profile:
        from .sim.profiles import get_profile

        check_sim_profile(settings.sim_profile)
        return get_profile(settings.sim_profile).vendor
    torch_vendor = settings.machine.torch_vendor or torch_build()[1]
    return "hip" if torch_vendor == "rocm" else "cuda"


def bindings_missing(vendor: str) -> str | None:
    """None when the vendor's Python bindings import (the simulation needs their types too), else why not."""
    try:
        if vendor == "hip":
            from hip import hip  # noqa: F401
        else:
            import cuda.bindings.driver  # noqa: F401
    except ImportError as exc:
        extra = "hip" if vendor == "hip" else "cuda"
        return f"{'hip-python' if vendor == 'hip' else 'cuda-python'} is not installed ({exc}); " \
               f"install membackend[{extra}]"
    return None


def open_gpu_driver(vendor: str, sim_profile: str | None = None) -> GpuDriver:
    """A driver wrapper for ``vendor``: over a fresh simulation of ``sim_profile`` when set, else the
    real bindings. Not initialised: the caller calls ``init()`` on first use."""
    if sim_profile:
        from .sim import get_profile, sim_driver

        check_sim_profile(sim_profile)
        profile = get_profile(sim_profile)
        if profile.vendor != vendor:
            raise ConfigError("sim_profile", "MEMBACKEND_SIM_PROFILE or settings",
                              f"profile {sim_profile!r} simulates {profile.vendor}, not {vendor}",
                              ", ".join(n for n in profile_names() if get_profile(n).vendor == vendor))
        return sim_driver(profile)
    if vendor == "hip":
        from .hip import HipDriver

        return HipDriver()
    from .cuda import CudaDriver

    return CudaDriver()


def open_sim_variant(sim_profile: str, **changes: Any) -> GpuDriver:
    """A driver over a fresh simulation of ``sim_profile`` with some of the profile's facts changed
    (replays draw the page-in latency and copy bandwidth per seed, or size a device as a report's):
    ``device_memory`` sets every device's memory; any other keyword replaces that field of the
    profile. An unknown field is a ``ConfigError`` listing the accepted ones."""
    import dataclasses

    from .sim import get_profile, sim_driver

    check_sim_profile(sim_profile)
    profile = get_profile(sim_profile)
    vram = changes.pop("device_memory", None)
    fields = {f.name for f in dataclasses.fields(profile)} - {"name", "vendor", "devices"}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ConfigError("profile variant", "replay", f"unknown profile field(s) {', '.join(unknown)}",
                          ", ".join(sorted(fields | {"device_memory"})))
    if vram is not None:
        changes["devices"] = tuple(dataclasses.replace(d, vram=int(vram)) for d in profile.devices)
    return sim_driver(dataclasses.replace(profile, **changes))


def simulated_failures() -> tuple[type[BaseException], ...]:
    """What ends a simulated machine (a kernel bugcheck, a runtime crash): ``BaseException``
    subclasses, so that nothing but a caller who asks for them catches them."""
    from .sim import SimulatedBugcheck, SimulatedCrash

    return (SimulatedBugcheck, SimulatedCrash)


class LazyDriver:
    """Opens (and initialises) the driver on first use, so constructing a backend touches no GPU."""

    def __init__(self, vendor: str, sim_profile: str | None = None):
        self.vendor = vendor
        self.sim_profile = sim_profile
        self.simulated = bool(sim_profile)

    def missing(self) -> str | None:
        """Why this driver cannot be opened (bindings absent), without opening it."""
        return bindings_missing(self.vendor)

    def __call__(self) -> GpuDriver:
        return open_gpu_driver(self.vendor, self.sim_profile)
