"""Sessions on simulated machines (and on the host backend), with public names only; no pytest needed.

The one builder of sessions for tests, benchmarks, a plugin's comparison and
workload code and the documentation's examples is :func:`simulated_session`:
a :class:`membackend.Session` over a fresh simulation of one profile
(``wddm-6gb``, ``rocm-win-2gpu``, ``gb10-128gb``, ``jetson-orin-16gb``,
``h200``, ...; :func:`simulated_profiles` lists them), by default on the
generic VMM mechanism with the profile's own knobs, else on a plugin's
``Platform``, a variant driver of the profile (:func:`simulated_driver`) or a
backend the caller built (the stock comfy-aimdo models below). Put a
``membackend.ResidencyManager(session)`` on it for the policy. The host
backend, which simulates nothing (it maps this process's own memory), has its
own: :func:`host_session`.

And what the callers of those sessions need besides:

* :func:`simulated_driver` — a driver over a fresh simulation of a profile,
  optionally a variant (other timings or sizes, holding no bytes);
* :func:`simulated_machine` — the machine facts of a profile, as discovery
  reads them;
* :func:`simulated_profiles` — the profile names;
* :func:`simulated_failures` — the exceptions that end a simulated machine
  (a kernel bugcheck, a runtime crash);
* :class:`StockManager`, :class:`AimdoStockVmm`, :class:`AimdoLoadManager` —
  membackend's models of stock ComfyUI + comfy-aimdo 0.5.x (the "stock" side
  of every comparison and of ``membackend replay``); their old names
  ``StockPolicy`` and ``AimdoLoadPolicy`` still work for one release, with a
  ``DeprecationWarning``.

Importing this module imports neither pytest nor hypothesis, so it runs without
the ``kit`` extra.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._backends.host import HostBackend
from .._backends.vmm import VmmBackend
from .._drivers.open import (
    check_sim_profile,
    machine_for,
    open_gpu_driver,
    open_sim_variant,
    profile_names,
    resolve_vendor,
)
from .._drivers.open import simulated_failures as _simulated_failures
from .._lazy import old_names
from .._ledger import Ledger
from .._machine import gather_machine
from .._session import Session
from .._settings import load_settings
from ..platform import GENERIC, Platform
from ..types import Capabilities, ConfigError, Machine
from ._replay.stock import RENAMED, AimdoLoadManager, AimdoStockVmm, StockManager, renamed

if TYPE_CHECKING:
    from .._drivers.gpu import GpuDriver

__all__ = ["simulated_session", "host_session", "simulated_driver", "simulated_machine", "simulated_profiles",
           "simulated_failures", "StockManager", "AimdoStockVmm", "AimdoLoadManager"]

_HERE = "simulated_session"


def simulated_session(profile: str, platform: Platform | None = None, *, backend: Any = None,
                      driver: GpuDriver | None = None, capabilities: Capabilities | None = None,
                      page_size: int | str | None = None, machine: Machine | Mapping[str, Any] | None = None,
                      observers: Iterable[Any] = (), **settings: Any) -> Session:
    """A session over a fresh simulation of ``profile``, with its own ledger.

    By default the backend is the generic VMM mechanism (``vmm``) over a fresh
    simulated driver of the profile:

    * ``platform``: a :class:`~membackend.platform.Platform` (a plugin's
      record), used exactly as that plugin uses it: its vendor, page size,
      capabilities and declared settings (read from the same sources as the
      other settings). None: the generic platform tuned with the profile's own
      knobs (unified pool, address quota, reserve-churn limit, fence
      granularity, page-in synchronisation of the profile's OS), which is what
      a platform plugin for that machine would declare.
    * ``capabilities`` replaces the platform's (or the profile's) knobs.
    * ``page_size`` replaces the platform's page size: bytes, or a size such
      as ``"64MiB"``, as the ``page_size`` setting takes it (a power of two, a
      multiple of the OS page, at most 1 GiB); the backend rounds it up to the
      device's allocation granularity.
    * ``driver``: a simulated driver of this same profile to run over instead
      of a fresh one, e.g. :func:`simulated_driver` ``(profile, hold_bytes=False,
      pagein_seconds=..., copy_bandwidth=...)``, a variant with other timings.

    ``backend``: a backend already built (a stock model such as
    :class:`AimdoStockVmm` over :func:`simulated_driver`, or a backend class of
    one's own), run as it is on the profile's machine instead of the generic
    one. It brings its own driver, page size and knobs, so ``platform``,
    ``driver``, ``capabilities`` and ``page_size`` are refused with it.

    For either kind:

    * ``machine``: the machine facts. None: the profile's, discovered through
      its simulated driver; a :class:`~membackend.types.Machine`: those facts
      as they are; a mapping: overrides of the profile's facts, as the
      ``machine`` setting takes them (``{"os": "windows"}``).
    * ``settings``: further keywords of :func:`membackend.load_settings`,
      applied with ``sim_profile=profile`` over the environment and the config
      files (keywords win): ``sanitize`` (the ledger's sanitize mode),
      ``headroom`` (the session's headroom setting), ``trace`` (a trace file).
    * ``observers``: pluggy observers around the verbs.

    The simulation is reached as ``session.backend.driver`` (its ``sim`` is the
    simulated platform, to inspect or to inject faults into). Every call makes a
    new simulation (unless ``driver`` or ``backend`` brings one), so sessions
    never share state. The caller closes the session (the kit's
    ``membackend_simulated`` fixture does it).

    Raises ``ConfigError`` naming what was wrong and what is accepted for: an
    unknown profile, a ``platform`` that is no ``Platform`` or whose vendor is
    not the profile's, ``capabilities`` that are no ``Capabilities``, a
    ``driver`` that is not a simulated driver of this profile (or not of the
    platform's vendor), a ``backend`` without a name or given with one of the
    options it refuses, a ``machine`` that is neither facts nor overrides, or a
    setting that cannot be used.
    """
    if platform is not None and not isinstance(platform, Platform):
        raise ConfigError("platform", _HERE, f"{platform!r} is not a Platform",
                          "a membackend.platform.Platform (a plugin's record), or None for the generic platform")
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise ConfigError("capabilities", _HERE, f"{capabilities!r} is not a Capabilities",
                          "a membackend.types.Capabilities, or None for the platform's (or the profile's) own")
    if backend is not None:
        _check_backend(backend, platform=platform, driver=driver, capabilities=capabilities, page_size=page_size)
    facts = _machine_option(machine, settings)
    if page_size is not None:
        settings["page_size"] = page_size
    s = load_settings(sim_profile=profile, **settings)
    check_sim_profile(profile)
    facts = facts if facts is not None else machine_for(s)
    if backend is None:
        chosen = platform or GENERIC
        vendor = resolve_vendor(chosen.vendor, s)
        if driver is None:
            driver = open_gpu_driver(vendor, profile)
        else:
            _check_driver(driver, profile, vendor)
        if capabilities is None and platform is None:
            capabilities = driver.sim.profile.capabilities()  # type: ignore[attr-defined]
        # the platform's own page size unless one is asked for, and its declared settings, as the plugin runs;
        # the session applies the headroom
        backend = VmmBackend(chosen, driver, capabilities=capabilities, machine=lambda: facts,
                             page_size=s.page_size if page_size is not None else None,
                             platform_values=chosen.setting_values(s))
    return _session(backend, facts, s, observers, sim_profile=profile)


def host_session(*, capacity: int | str | None = None, headroom: int | str | None = None,
                 page_size: int | str | None = None, observers: Iterable[Any] = (), **settings: Any) -> Session:
    """A session on the host backend (``host``): this process's own memory, on this machine's facts.

    Nothing is simulated: pages are mapped with ``mmap`` / ``VirtualAlloc``
    and the budget is the host's ``MemAvailable`` (or the memory cgroup's
    limit). For tests and benchmarks that want a bounded, repeatable budget:

    * ``capacity``: the most the backend may keep resident (bytes, or a size
      such as ``"256MiB"``; the ``host_capacity`` setting): the budget's total
      becomes this cap. None: no cap unless the settings set one.
    * ``headroom``: bytes kept free (the session's ``headroom`` setting, as for
      :func:`simulated_session`). None: the setting's, else the backend's own
      (512 MiB).
    * ``page_size``: the backend's page size (a power-of-two multiple of the
      OS page; default 2 MiB).
    * ``settings``: further keywords of :func:`membackend.load_settings` over
      the environment and the config files (keywords win): ``sanitize``,
      ``trace``, ``machine`` (overrides of this machine's facts).
    * ``observers``: pluggy observers around the verbs.

    The caller closes the session. Raises ``ConfigError`` for a value that
    cannot be used (a negative or unparsable size, a page size the OS cannot
    map), and for ``sim_profile`` or ``backend`` among the keywords: a
    simulated GPU is :func:`simulated_session`'s.
    """
    for key in ("sim_profile", "backend"):
        if key in settings:
            raise ConfigError(key, "host_session", "a host session runs the host backend on this machine",
                              "simulated_session(profile, ...) for a simulated GPU, or leave it out")
    given = {k: v for k, v in (("host_capacity", capacity), ("headroom", headroom), ("page_size", page_size))
             if v is not None}
    s = load_settings(**given, **settings)
    try:
        backend = HostBackend(page_size=s.page_size, capacity=s.host_capacity)
    except ValueError as exc:
        raise ConfigError("page_size", "host_session", str(exc), "a power-of-two multiple of the OS page") from None
    return _session(backend, gather_machine(s.machine), s, observers, sim_profile=None)


def simulated_driver(profile: str, vendor: str | None = None, *, hold_bytes: bool = True,
                     **changes: Any) -> GpuDriver:
    """A driver wrapper over a fresh simulation of ``profile`` (or of a variant of it).

    What :func:`simulated_session` runs over by default: ``session.backend.driver``
    is one of these. Use it to build a backend of one's own for
    ``simulated_session(profile, backend=...)`` (``AimdoStockVmm(driver)``),
    or to pass a variant as ``simulated_session(profile, driver=...)``.

    * ``vendor``: ``cuda`` or ``hip``, checked against the profile's (None:
      the profile's own).
    * ``changes``: facts of the profile replaced in this simulation only (a
      replay draws the page-in latency and copy bandwidth per seed):
      ``device_memory`` sets every device's memory in bytes; any other keyword
      replaces that field of the profile (``pagein_seconds``,
      ``copy_bandwidth``, ...). The name stays the profile's.
    * ``hold_bytes=False``: the simulation keeps books only, no bytes behind the
      pages (a machine larger than this one, or copies modelled by size and time).

    The driver is not initialised yet; a backend does it on first use (the
    driver's ``init()``). Its ``sim`` is the simulated platform. Every call
    makes a new simulation. Raises ``ConfigError`` for an unknown profile, an
    unknown vendor, a vendor the profile does not simulate, or an unknown
    field among ``changes`` (naming the accepted ones).
    """
    check_sim_profile(profile)
    if vendor is not None:
        resolve_vendor(vendor, None)  # an unknown vendor: ConfigError naming cuda and hip
    driver = open_sim_variant(profile, hold_bytes=hold_bytes, **changes)
    if vendor is not None and driver.vendor != vendor:
        raise ConfigError("vendor", "simulated_driver", f"profile {profile!r} simulates {driver.vendor}, not {vendor}",
                          f"{driver.vendor}, or None for the profile's own")
    return driver


def simulated_machine(profile: str) -> Machine:
    """The machine facts of ``profile`` (OS, host RAM, torch build, devices), discovered through its simulated
    driver as membackend discovers a real machine's, with the ``machine`` overrides of the settings
    (``MEMBACKEND_MACHINE__*``, the config files) applied. Discovered once per process; RAM read now.
    Raises ``ConfigError`` for an unknown profile (naming the known ones) or a setting that cannot be used."""
    check_sim_profile(profile)
    return machine_for(load_settings(sim_profile=profile))


def simulated_profiles(vmm_only: bool = False) -> tuple[str, ...]:
    """The names of the simulated machines, in a fixed order; ``vmm_only``: only those whose every device
    supports virtual memory management (the machines the VMM backend, and so :func:`simulated_session`'s
    default, can serve)."""
    return profile_names(vmm_only=bool(vmm_only))


def simulated_failures() -> tuple[type[BaseException], ...]:
    """``(SimulatedBugcheck, SimulatedCrash)``: what ends a simulated machine, a kernel bugcheck (an unmap or
    release while the WDDM page-in or a copy was pending) and a runtime crash (the address quota passed).
    They are ``BaseException`` subclasses, so nothing but a caller who names them catches them:
    ``except simulated_failures():`` or ``except simulated_failures()[0]:`` for the bugcheck alone."""
    return _simulated_failures()


# --------------------------------------------------------------------------- helpers


def _check_backend(backend: Any, **refused: Any) -> None:
    given = [name for name, value in refused.items() if value is not None]
    if given:
        raise ConfigError(given[0], _HERE, f"{', '.join(given)} given together with backend={backend!r}, which "
                                           "brings its own", "backend= alone, or the options without it")
    if not isinstance(getattr(backend, "name", None), str):
        raise ConfigError("backend", _HERE, f"{backend!r} is no backend (it has no name)",
                          "a backend object: a name and the @hookimpl verbs (AimdoStockVmm(simulated_driver(p)), "
                          "a backend class of one's own), or None for the generic VMM backend")


def _check_driver(driver: Any, profile: str, vendor: str) -> None:
    simulated = getattr(getattr(getattr(driver, "sim", None), "profile", None), "name", None)
    if simulated != profile:
        what = f"a simulated driver of profile {simulated!r}" if simulated else "not a simulated driver"
        raise ConfigError("driver", _HERE, f"{driver!r} is {what}, not of {profile!r}",
                          f"simulated_driver({profile!r}, ...), or None for a fresh simulation")
    if driver.vendor != vendor:
        raise ConfigError("driver", _HERE, f"the driver is a {driver.vendor} driver; the platform needs {vendor}",
                          f"simulated_driver({profile!r}, {vendor!r}) of a {vendor} profile")


def _machine_option(machine: Any, settings: dict[str, Any]) -> Machine | None:
    """Facts given as they are (returned), or overrides put among ``settings`` (None returned)."""
    if machine is None or isinstance(machine, Machine):
        return machine
    if not isinstance(machine, Mapping):
        raise ConfigError("machine", _HERE, f"{machine!r} is neither machine facts nor overrides",
                          "a membackend.types.Machine, a mapping of overrides such as {'os': 'windows'}, or None")
    settings["machine"] = dict(machine)
    return None


def _session(backend: Any, machine: Machine, s: Any, observers: Iterable[Any], sim_profile: str | None) -> Session:
    """``backend`` in a session with its own ledger, the settings' headroom and sanitize mode, and their trace."""
    watchers = list(observers)
    tracer = None
    if s.trace is not None:
        from .._trace import TraceObserver

        tracer = TraceObserver(s.trace, backend=backend.name, sim_profile=sim_profile,  # None: real hardware
                               devices=[{"device": str(d.device), "name": d.name, "total_memory": d.total_memory}
                                        for d in machine.devices])
        watchers.append(tracer)
    return Session(backend, machine=machine, ledger=Ledger(sanitize=s.sanitize), observers=watchers,
                   headroom=s.headroom, tracer=tracer)


if TYPE_CHECKING:  # a type checker still reads the managers' old names for their last release (the same classes)
    StockPolicy = StockManager
    AimdoLoadPolicy = AimdoLoadManager
else:  # hidden from type checkers, so that a misspelt name is an error there and not Any
    __getattr__ = old_names(__name__, RENAMED, renamed)
