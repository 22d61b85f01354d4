"""The one place that picks a real or a simulated driver, for discovery and for the backends.

Settings, machine facts and backends know nothing of the simulation: they ask
here. With ``sim_profile`` set (``MEMBACKEND_SIM_PROFILE=<profile>``) the GPU
driver is the profile's simulated twin and the host is the profile's
simulated host; without it the real cuda-python, hip-python or ctypes HIP
wrappers and this machine are used. Either way the machine facts come out of
the same discovery code (:mod:`membackend._drivers.discovery`) reading that
driver; the settings' ``machine`` overrides (``MEMBACKEND_MACHINE__*``) are
applied last, as the user's explicit word. Profile names are validated here,
where the simulation lives.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
from typing import Any

from ..types import ConfigError, DriverError, Machine
from .discovery import Bindings, Discovered, RealHost, apply_overrides, assemble, discover, torch_build
from .gpu import GpuDriver

__all__ = ["profile_names", "check_sim_profile", "machine_for", "gather", "discovery_for", "refresh",
           "resolve_vendor", "bindings_missing", "open_gpu_driver", "open_sim_variant", "simulated_failures",
           "LazyDriver"]

VENDORS = ("cuda", "hip")


def profile_names(vmm_only: bool = False) -> tuple[str, ...]:
    """The simulated platforms ``sim_profile`` accepts; ``vmm_only``: those whose every device supports
    virtual memory management (the machines a VMM backend can serve)."""
    from .sim.profiles import PROFILES

    return tuple(n for n, p in PROFILES.items() if not vmm_only or all(d.vmm for d in p.devices))


def check_sim_profile(name: str | None, source: str = "MEMBACKEND_SIM_PROFILE or settings") -> None:
    """Raise ``ConfigError`` (key ``sim_profile``, from ``source``) when ``name`` is set and not a known
    profile, with the closest name (``sim.profiles.get_profile``'s refusal)."""
    if name is not None:
        from .sim.profiles import get_profile

        get_profile(name, source)


# --------------------------------------------------------------------------- real openers

#: the driver libraries the bindings load by name from the system's search path: cuda-python's
#: ``libcuda.so.1`` / ``nvcuda.dll``, hip-python's ``libamdhip64.so``
_SYSTEM_LIBRARY = {"cuda": "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1", "hip": "libamdhip64.so"}


def _system_library(vendor: str) -> None:
    """Raise ``DriverError("unavailable", "dlopen")`` unless the library the vendor's Python binding
    loads by name is there (``dlopen`` of the same name returns the binding the same handle later);
    so discovery imports no binding that could only fail."""
    name = _SYSTEM_LIBRARY[vendor]
    try:
        ctypes.CDLL(name)
    except OSError as exc:
        binding = "cuda-python" if vendor == "cuda" else "hip-python"
        raise DriverError("unavailable", "dlopen", f"{name} is not on the library search path ({exc}); "
                                                   f"{binding} not asked") from None


def _discovered_cuda() -> GpuDriver:
    _system_library("cuda")
    return _real_cuda()


def _discovered_hip_python() -> GpuDriver:
    if sys.platform != "win32":  # Windows has no hip-python: its import fails on its own, fast
        _system_library("hip")
    return _hip_python()


def _real_cuda() -> GpuDriver:
    from .cuda import CudaDriver

    return CudaDriver()


def _hip_python() -> GpuDriver:
    from .hip import HipDriver

    return HipDriver()


def _hip_ctypes() -> GpuDriver:
    from .hip import HipDriver
    from .hip_ctypes import load

    return HipDriver(load())


# --------------------------------------------------------------------------- discovery


def discovery_for(sim_profile: str | None = None, torch_vendor: str | None = "?") -> Bindings:
    """What machine discovery asks: the simulated host and driver of ``sim_profile``, or this
    machine with the real bindings (CUDA; NVML and ``/proc/driver/nvidia`` as supplements; HIP
    through hip-python, then the ctypes binding). On a real machine a vendor torch's build cannot
    use is not asked (``torch_vendor``: ``cuda`` skips HIP, ``rocm`` skips CUDA; ``?``: read it)."""
    if sim_profile:
        from .sim import SimHost, get_profile, sim_driver

        check_sim_profile(sim_profile)
        profile = get_profile(sim_profile)

        def opener() -> GpuDriver:
            return sim_driver(profile)
        return Bindings(host=SimHost(profile), cuda=opener if profile.vendor == "cuda" else None,
                        hip=(opener,) if profile.vendor == "hip" else ())
    if torch_vendor == "?":
        torch_vendor = torch_build()[1]
    visible = {k: v for k, v in os.environ.items() if k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}
    return Bindings(host=RealHost(), cuda=None if torch_vendor == "rocm" else _discovered_cuda,
                    hip=() if torch_vendor == "cuda" else (_discovered_hip_python, _hip_ctypes),
                    nvml=torch_vendor != "rocm", proc_nvidia=torch_vendor != "rocm", environ=visible)


@functools.lru_cache(maxsize=None)
def _discovered(sim_profile: str | None) -> tuple[Discovered, Any]:
    """Discovery runs once per process and profile: the drivers read their environment once too."""
    bindings = discovery_for(sim_profile)
    found = discover(bindings)
    if not bindings.hip and bindings.cuda is not None and not sim_profile:
        found = _note(found, "hip: not asked (torch is a CUDA build, which does not use HIP devices)")
    if bindings.cuda is None and not sim_profile:
        found = _note(found, "cuda: not asked (torch is a ROCm build, which does not use CUDA devices)")
    return found, bindings.host


def _note(found: Discovered, line: str) -> Discovered:
    return dataclasses.replace(found, discovery=found.discovery + (line,))


def refresh() -> None:
    """Forget what discovery found, so the next machine is discovered again (for tests)."""
    _discovered.cache_clear()


def gather(overrides: Any = None, sim_profile: str | None = None) -> Machine:
    """The machine: discovered once (real, or the simulated ``sim_profile``), RAM read now, then
    ``overrides`` (a ``MachineOverrides``) applied. Never raises for a driver that fails."""
    found, host = _discovered(sim_profile)
    return apply_overrides(assemble(found, host.memory()), overrides)


def machine_for(settings: Any) -> Machine:
    """The machine the settings describe: discovered through the real or simulated drivers
    (``sim_profile``), then the user's ``machine`` overrides."""
    check_sim_profile(settings.sim_profile)
    return gather(settings.machine, settings.sim_profile)


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


def bindings_missing(vendor: str, simulated: bool = False) -> str | None:
    """None when a binding for ``vendor`` is there, else why not.

    CUDA: cuda-python imports. HIP: hip-python imports, or the ctypes binding
    finds and loads the HIP runtime (:func:`membackend._drivers.hip_ctypes.load`).
    A simulated driver needs neither: it uses the bindings' types where they
    import and its own copies of them otherwise.
    """
    if simulated:
        return None
    if vendor == "hip":
        try:
            from hip import hip  # noqa: F401
            return None
        except ImportError as exc:
            missing = f"hip-python is not installed ({exc})"
        from .hip_ctypes import load

        try:
            load()
        except DriverError as exc:
            return f"{missing}, and {exc}; install a ROCm build of torch (its torch/lib has the HIP runtime)" \
                   " or membackend[hip] (Linux)"
        return None
    try:
        from .cuda import _import_driver

        _import_driver()
    except ImportError as exc:
        return f"cuda-python is not installed ({exc}); install membackend[cuda]"
    return None


def open_gpu_driver(vendor: str, sim_profile: str | None = None) -> GpuDriver:
    """A driver wrapper for ``vendor``: over a fresh simulation of ``sim_profile`` when set, else the
    real bindings (HIP: hip-python, else the ctypes binding). The caller calls ``init()`` on first
    use (the real HIP opener may have called ``hipInit`` already to pick a binding; it is idempotent)."""
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
        return _open_real_hip()
    return _real_cuda()


def _open_real_hip() -> GpuDriver:
    """hip-python where it imports and loads its runtime (``hipInit`` is asked to find out), else the
    ctypes binding of the runtime torch's ROCm build ships; raises ``DriverError`` when neither can."""
    try:
        driver = _hip_python()
    except ImportError:
        return _hip_ctypes()
    try:
        driver.init()
    except DriverError as exc:
        if exc.code != "unavailable":
            return driver  # the runtime answered (no device, ...): the caller sees the same answer
        return _hip_ctypes()
    return driver


def open_sim_variant(sim_profile: str, *, hold_bytes: bool = True, **changes: Any) -> GpuDriver:
    """A driver over a fresh simulation of ``sim_profile`` with some of the profile's facts changed
    (replays draw the page-in latency and copy bandwidth per seed, or size a device as a report's):
    ``device_memory`` sets every device's memory; any other keyword replaces that field of the
    profile. An unknown field is a ``ConfigError`` listing the accepted ones. ``hold_bytes=False``: the
    simulation keeps books only (a replay models sizes and times of machines larger than this one)."""
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
    return sim_driver(dataclasses.replace(profile, **changes), hold_bytes=hold_bytes)


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
        """Why this driver cannot be opened (bindings absent), without initialising it."""
        return bindings_missing(self.vendor, self.simulated)

    def __call__(self) -> GpuDriver:
        return open_gpu_driver(self.vendor, self.sim_profile)
