"""The ``Platform`` record: what a platform plugin contributes, as data plus a probe.

A platform is everything the generic virtual-memory backend needs to know to
serve one kind of machine well: its name (the backend's name), its vendor
(which driver bindings), a probe that says when it fits, where its budget
comes from, the :class:`~membackend.types.Capabilities` that tune the
residency policy, and defaults (page size, headroom). The mechanism is the
same for all of them: :class:`membackend._backends.vmm.VmmBackend` is *built
from* a Platform and a driver and names itself after the platform.

A platform plugin is one module with one ``Platform`` and one entry point in
the ``membackend.backends`` group naming it::

    [project.entry-points."membackend.backends"]
    my_platform = "my_package:PLATFORM"

The built-in generic platform is :data:`GENERIC` (backend name ``vmm``).

**Settings a platform declares.** A platform that needs settings of its own
declares them, and never reads the environment itself::

    PLATFORM = Platform(name="my_platform", ..., headroom=headroom,
                        settings=(PlatformSetting("headroom", parse=size, default=512 * MiB,
                                                  doc="bytes kept free under the budget"),))

membackend reads each under the platform's name, from the same sources and in
the same order as its own settings (``docs/settings.md``): a keyword argument
``my_platform={"headroom": "1GiB"}``, the variable
``MEMBACKEND_MY_PLATFORM_HEADROOM``, a ``[my_platform]`` table in
``membackend.toml``, ``[tool.membackend.my_platform]`` in ``pyproject.toml``,
then the default. It reads them once, when the backend is built, through the
setting's ``parse`` (membackend's own rules: :data:`size`, :data:`flag`,
:data:`seconds`, or any function that raises ``ValueError`` saying what is
wrong): a bad value is a :class:`~membackend.types.ConfigError` naming
``my_platform.headroom``, its source and what is accepted, and the plugin is
listed as broken with that message. The values, a :class:`PlatformValues`
(``settings["headroom"]``, ``settings.source("headroom")``), reach the
platform's functions that take a parameter named ``settings``:
``probe(machine, settings)``, ``headroom(total, settings)`` and
``capabilities(settings)`` (``capabilities`` may be such a function when a
knob depends on a setting). ``membackend doctor`` shows every value with its
source.
"""

from __future__ import annotations

import inspect
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from ._drivers.gpu import BUDGET_SOURCES as DRIVER_BUDGET_SOURCES
from ._settings.rules import FIELD_NAMES, SIZE_ACCEPTED, Rule, RuleError, flag, format_bytes, seconds, size
from ._settings.sources import PlatformValues, Sources, platform_env_name, resolve_platform
from .types import Candidate, Capabilities, Device, DeviceInfo, Machine, Score, format_size

__all__ = ["Platform", "PlatformSetting", "PlatformValues", "GENERIC", "vmm_unsupported", "KEPT_WINDOWS_PER_DEVICE",
           "CHURN_MARGIN", "size", "flag", "seconds", "Rule", "RuleError", "SIZE_ACCEPTED", "format_bytes",
           "ONE_POOL", "one_pool_headroom", "ONE_POOL_HEADROOM_FRACTION", "ONE_POOL_HEADROOM_MIN",
           "ONE_POOL_HEADROOM_MAX", "amd_unfit", "Headroom", "HeadroomByDevice", "HEADROOM_LIVE"]

MiB, GiB = 1 << 20, 1 << 30
#: what ``Platform.budget_source`` accepts: the driver's sources, and ``auto`` (one pool on an integrated
#: device, the device's own figures elsewhere: the generic platform's choice)
BUDGET_SOURCES = (*DRIVER_BUDGET_SOURCES, "auto")
#: kept address windows per device under a reserve-churn limit, at least this bound (more where the device
#: had more large reservations alive at once): what stays reserved once the platform allows no more frees
KEPT_WINDOWS_PER_DEVICE = 4
#: large frees left unspent under a reserve-churn limit (the limit is one reproducer's count, rocm-systems #6191)
CHURN_MARGIN = 2
NAME_PATTERN = r"^[a-z][a-z0-9_\-]*$"
SETTING_NAME = re.compile(r"[a-z][a-z0-9_]*", re.ASCII)


class PlatformSetting:
    """One setting a platform declares (see the module docstring).

    * ``name``: lower-case letters, digits and ``_``, starting with a letter;
      the key in the platform's tables and, upper-cased, the end of its
      variable ``MEMBACKEND_<PLATFORM>_<NAME>``.
    * ``parse(raw) -> value``: takes the value as a source gives it (text from
      the environment, a TOML value, a keyword argument) and returns it parsed,
      or raises ``ValueError`` saying what is wrong. membackend's rules
      (:data:`size`, :data:`flag`, :data:`seconds`) say what they accept.
    * ``default``: the value (already parsed) when no source gives one; None
      may mean "not set" to the platform's functions.
    * ``doc``: what it means, for the doctor and the plugin's documentation.
    * ``accepted``: what ``parse`` accepts, for every error message; by
      default the rule's own text (a plain function must say it here).

    Read-only; equal when every part is. (A plain class rather than a
    dataclass: defining one costs about 2 ms on the ComfyUI adapter's start-up.)
    """

    __slots__ = ("name", "parse", "default", "doc", "accepted")
    name: str
    parse: Callable[[Any], Any]
    default: Any
    doc: str
    accepted: str

    def __init__(self, name: str, parse: Callable[[Any], Any], default: Any = None, doc: str = "",
                 accepted: str = ""):
        if not isinstance(name, str) or not SETTING_NAME.fullmatch(name):
            raise ValueError(f"setting name {name!r}: accepted: lower-case letters, digits and '_', "
                             "starting with a letter")
        if not callable(parse):
            raise ValueError(f"setting {name!r}: parse must be callable(raw value) -> value")
        accepted = accepted or getattr(parse, "accepted", "")
        if not isinstance(accepted, str) or not accepted:
            raise ValueError(f"setting {name!r}: say what parse accepts (accepted=...), for its error messages")
        for attr, value in (("name", name), ("parse", parse), ("default", default), ("doc", doc),
                            ("accepted", accepted)):
            object.__setattr__(self, attr, value)

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError(f"PlatformSetting {self.name!r} is read-only")

    def _parts(self) -> tuple[Any, ...]:
        return self.name, self.parse, self.default, self.doc, self.accepted

    def __reduce__(self) -> tuple[Any, ...]:
        return PlatformSetting, self._parts()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlatformSetting) and self._parts() == other._parts()

    def __hash__(self) -> int:
        return hash((self.name, self.doc, self.accepted))

    def __repr__(self) -> str:
        return f"PlatformSetting({self.name!r}, parse={self.parse!r}, default={self.default!r})"


# ---------------------------------------------------------------------- the one-pool rules

#: what a platform whose devices share one memory pool with the host tells the mechanism and the policy
#: (``unified_gb10``; ``rocm_linux`` on an APU through the ``auto`` budget source, which makes an integrated
#: device one pool): a fault past the pool is refused before the driver is asked (a GB10 driver refusing late
#: aborts the loader, ComfyUI #15285); a full unload returns the range and its pages to the pool (G1); freed
#: physical memory is released, never kept for reuse (a kept handle is pool memory the host cannot have); no
#: video memory manager pages mappings in (Linux), so the fence tokens cover every free. The rest of the rules
#: follow from a budget that says ``unified``: models kept warm across workflow switches while the pool allows
#: (G4, the residency manager), and no pinned host copies of weights (the ComfyUI adapter: a pinned copy on the
#: same memory is the model twice)
ONE_POOL = Capabilities(unified_pool=True, release_on_full_unload=True, recycle_handles=False,
                        fence_granularity="reservation", page_in_sync="never")
#: the headroom of a pool: this fraction of it, within [MIN, MAX] (and never more than half of it)
ONE_POOL_HEADROOM_FRACTION = 1 / 8
ONE_POOL_HEADROOM_MIN = 1 * GiB  # what the OS and the process's own activations need on a small Jetson
ONE_POOL_HEADROOM_MAX = 16 * GiB  # ComfyUI #15285: a GB10 (121 GiB) user ran stably with --reserve-vram 16


def one_pool_headroom(total: int) -> int:
    """Bytes kept free of a pool of ``total`` bytes shared with the host: ``total`` x
    :data:`ONE_POOL_HEADROOM_FRACTION` within [:data:`ONE_POOL_HEADROOM_MIN`, :data:`ONE_POOL_HEADROOM_MAX`],
    never more than half the pool (16 GiB on a 128 GB GB10, 4 GiB on a 32 GB Jetson)."""
    return min(max(int(total * ONE_POOL_HEADROOM_FRACTION), ONE_POOL_HEADROOM_MIN), ONE_POOL_HEADROOM_MAX,
               total // 2)


def takes_parameter(fn: Any, parameter: str) -> bool:
    """Whether ``fn`` accepts the keyword ``parameter`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return parameter in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _takes_settings(fn: Any) -> bool:
    """Whether ``fn`` has a parameter named ``settings`` (then it is handed the platform's values)."""
    try:
        return "settings" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@dataclass(frozen=True)
class Platform:
    """One platform; see the module docstring.

    * ``probe(machine) -> Candidate``: pure (no GPU context, no allocation);
      score on :class:`~membackend.types.Score`'s scale. The backend adds the
      check that the vendor's bindings are installed.
    * ``vendor``: ``cuda`` or ``hip``; None only for the generic platform,
      which follows the machine's torch build.
    * ``budget_source``: ``device`` (mem-get-info), ``wddm`` (the DXGI
      video-memory budget), ``unified`` (MemAvailable capped by the cgroup) or
      ``auto`` (``unified`` on a device that shares one pool with the host,
      ``device`` elsewhere).
    * ``capabilities``: a :class:`~membackend.types.Capabilities`, or
      ``capabilities(settings) -> Capabilities`` when a knob depends on a
      setting the platform declares; the record then keeps the function's
      answer for the defaults as ``capabilities`` (what the platform is
      unless configured), and :meth:`capabilities_for` asks it again with the
      values read.
    * ``page_size``: rounded up to the driver's granularity per device.
    * ``headroom``: bytes kept free on every device (for activations, and
      what the OS needs), or a function of the device's total bytes (e.g. a
      fraction of a unified pool within bounds). It is the platform's own
      rule, below the session's other sources (``Session.headroom_in_force``:
      a live change, ComfyUI's flags and the ``headroom`` setting win over it).
    * ``settings``: the :class:`PlatformSetting` records the platform
      declares; ``probe``, a callable ``headroom`` and a callable
      ``capabilities`` that take a parameter named ``settings`` receive their
      values (a :class:`PlatformValues`).
    """

    name: str
    probe: Callable[..., Candidate]
    vendor: str | None = None
    budget_source: str = "device"
    capabilities: Capabilities | Callable[..., Capabilities] = field(default_factory=Capabilities)
    page_size: int = 2 * MiB
    headroom: int | Callable[..., int] = 256 * MiB  # comfy-aimdo keeps this much VRAM free (VRAM_HEADROOM)
    description: str = ""
    version: str | None = None
    settings: tuple[PlatformSetting, ...] = ()
    #: ``capabilities`` when it was given as a function of the settings (see :meth:`capabilities_for`); set
    #: from ``capabilities`` (an init field only so that ``dataclasses.replace`` keeps the rule)
    capabilities_rule: Callable[..., Capabilities] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.match(NAME_PATTERN, self.name):
            raise ValueError(f"platform name {self.name!r} must match {NAME_PATTERN}")
        if self.vendor not in (None, "cuda", "hip"):
            raise ValueError(f"platform {self.name!r}: vendor {self.vendor!r}; accepted: cuda, hip")
        if self.budget_source not in BUDGET_SOURCES:
            raise ValueError(f"platform {self.name!r}: budget source {self.budget_source!r}; "
                             f"accepted: {', '.join(BUDGET_SOURCES)}")
        if not callable(self.probe):
            raise ValueError(f"platform {self.name!r}: probe must be callable(machine) -> Candidate")
        if self.page_size <= 0 or (not callable(self.headroom) and self.headroom < 0):
            raise ValueError(f"platform {self.name!r}: page_size must be > 0 and headroom >= 0 "
                             "(or a function of the device's total bytes)")
        if not (isinstance(self.capabilities, Capabilities) or callable(self.capabilities)):
            raise ValueError(f"platform {self.name!r}: capabilities must be a Capabilities or "
                             "capabilities(settings) -> Capabilities")
        self._check_settings()
        if callable(self.capabilities):
            object.__setattr__(self, "capabilities_rule", self.capabilities)
            object.__setattr__(self, "capabilities", self.capabilities_for(self.default_values()))

    def _check_settings(self) -> None:
        declared = tuple(self.settings)
        object.__setattr__(self, "settings", declared)
        names = [s.name for s in declared if isinstance(s, PlatformSetting)]
        if len(names) != len(declared):
            raise ValueError(f"platform {self.name!r}: settings must be PlatformSetting records")
        if len(set(names)) != len(names):
            raise ValueError(f"platform {self.name!r}: a setting is declared twice: {', '.join(names)}")
        if declared and self.name in FIELD_NAMES:
            raise ValueError(f"platform {self.name!r}: a platform named like one of membackend's own settings "
                             "cannot declare settings (its table would be that setting)")
        for n in names:  # MEMBACKEND_HOST_CAPACITY stays membackend's own, never platform host's 'capacity'
            if platform_env_name(self.name, n).removeprefix("MEMBACKEND_").lower() in FIELD_NAMES:
                raise ValueError(f"platform {self.name!r}: setting {n!r} would be read from "
                                 f"{platform_env_name(self.name, n)}, one of membackend's own settings")

    # ------------------------------------------------------------------ the declared settings

    def env_name(self, setting: str) -> str:
        """The variable that sets one of this platform's settings: ``MEMBACKEND_<PLATFORM>_<NAME>``."""
        return platform_env_name(self.name, setting)

    def default_values(self) -> PlatformValues:
        """Every declared setting at its default (no source read)."""
        return PlatformValues(self.name, {s.name: s.default for s in self.settings},
                              kinds={s.name: getattr(s.parse, "kind", "value") for s in self.settings})

    def setting_values(self, settings: Any = None) -> PlatformValues:
        """The declared settings' values, from the sources ``settings`` (a loaded ``Settings`` or
        ``QuickSettings``) were read from, or, without them, from the sources as they are now.

        Raises :class:`~membackend.types.ConfigError` for a value its ``parse``
        refuses or a key the platform does not declare in one of its tables.
        """
        snapshot = getattr(settings, "snapshot", None)
        sources = snapshot() if callable(snapshot) else None
        return resolve_platform(self.name, self.settings, sources if sources is not None else Sources.read())

    def _values(self, values: PlatformValues | None) -> PlatformValues:
        return values if values is not None else self.default_values()

    # ------------------------------------------------------------------ the functions, with the values

    def probe_for(self, machine: Machine, values: PlatformValues | None = None) -> Candidate:
        """The probe's answer; ``values``: this platform's settings (None: the defaults)."""
        if _takes_settings(self.probe):
            return self.probe(machine, settings=self._values(values))
        return self.probe(machine)

    def capabilities_for(self, values: PlatformValues | None = None) -> Capabilities:
        """The capabilities, with this platform's settings where they depend on them (None: the defaults)."""
        rule = self.capabilities_rule
        if rule is None:  # __post_init__ replaced a rule by its answer: a Capabilities
            return cast(Capabilities, self.capabilities)
        caps = rule(settings=self._values(values)) if _takes_settings(rule) else rule()
        if not isinstance(caps, Capabilities):
            raise ValueError(f"platform {self.name!r}: capabilities() gave {caps!r}; accepted: a Capabilities")
        return caps

    def headroom_for(self, total: int, values: PlatformValues | None = None, integrated: bool = False) -> int:
        """The platform's own headroom in bytes on a device of ``total`` bytes (``values``: its settings;
        None: the defaults). A rule that takes a parameter named ``integrated`` is told whether the device
        shares one pool with the host (a platform that serves discrete cards and APUs alike)."""
        rule = self.headroom
        if callable(rule):
            extra: dict[str, Any] = {"settings": self._values(values)} if _takes_settings(rule) else {}
            if takes_parameter(rule, "integrated"):
                extra["integrated"] = integrated
            value = rule(total, **extra)
        else:
            value = rule
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"platform {self.name!r}: headroom({total}) gave {value!r}; accepted: an int >= 0")
        return value

    def headroom_source(self, values: PlatformValues | None = None) -> str:
        """Where :meth:`headroom_for` comes from, in words (``Session.headroom_in_force``, the doctor)."""
        values = self._values(values)
        if "headroom" in values and values.source("headroom") != "default":
            return f"platform {self.name}'s own rule ({self.name}.headroom from {values.source('headroom')})"
        if callable(self.headroom):
            return f"platform {self.name}'s own rule"
        return f"platform {self.name}'s own rule ({format_size(self.headroom)})"


_VMM_ATTRIBUTE = {"cuda": "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                  "hip": "hipDeviceAttributeVirtualMemoryManagementSupported"}


def vmm_unsupported(gpus: tuple[DeviceInfo, ...] | list[DeviceInfo]) -> str | None:
    """Why a virtual-memory backend cannot serve ``gpus``, or None when every one supports virtual
    memory management (``DeviceInfo.vmm_supported`` is true).

    A device that reports no support fails its first ``cuMemCreate`` / ``hipMemCreate`` with
    ...NOT_SUPPORTED; one whose support is unknown was not listed through the driver API (NVML or
    ``/proc`` only, or a driver that did not answer), which a VMM backend needs anyway. Every VMM
    probe scores 0 with this reason.
    """
    for d in gpus:
        if d.vmm_supported:
            continue
        attr = _VMM_ATTRIBUTE.get(d.device.kind, "virtual memory management support")
        named = f"{d.device} ({d.name or 'unnamed'})"
        if d.vmm_supported is False:
            return (f"{named} does not support virtual memory management ({attr} = 0, from "
                    f"{d.source_of('vmm_supported') or d.source}); the host backend serves it")
        return (f"{named}: virtual memory management support is unknown ({attr} was not answered; the device "
                f"was listed by {d.source or 'nothing'}), and a VMM backend needs the driver API that answers it")
    return None


def amd_unfit(machine: Machine, name: str, check: str) -> Candidate | None:
    """What an AMD platform's probe answers (score 0, its reason) when the machine's torch build does not
    use AMD GPUs, no HIP device is listed (``check``: what the user should check, in words), or a HIP
    device is not an AMD ``gfx`` GPU; None when every listed HIP device is one (``machine.gpus("hip")``)."""
    if machine.torch_vendor in ("cuda", "cpu"):
        return Candidate(name, Score.NONE, f"torch is a {machine.torch_vendor} build, which does not use AMD GPUs; "
                                           "install a ROCm build of torch")
    gpus = machine.gpus("hip")
    if not gpus:
        return Candidate(name, Score.NONE, "no HIP device listed (discovery through hip-python or the HIP "
                                           "runtime found none: see the discovery lines of `membackend doctor`; "
                                           f"check {check})")
    foreign = [d for d in gpus if d.arch and not d.arch.startswith("gfx")]
    if foreign:
        listed = ", ".join(f"{d.device} {d.name} ({d.arch})" for d in foreign)
        return Candidate(name, Score.NONE, f"HIP device(s) that are not AMD GPUs: {listed}")
    return None


def _generic_probe(machine: Machine) -> Candidate:
    """Any CUDA or HIP device (HIP's when torch is a ROCm build), each supporting virtual memory
    management; score 20, in the generic band."""
    vendor = "hip" if machine.torch_vendor == "rocm" else None
    gpus = machine.gpus(vendor)
    if not gpus:
        return Candidate("vmm", Score.NONE, f"no {vendor.upper() if vendor else 'CUDA or HIP'} device found")
    kind = gpus[0].device.kind
    gpus = machine.gpus(kind)
    lacking = vmm_unsupported(gpus)
    if lacking:
        return Candidate("vmm", Score.NONE, lacking)
    names = ", ".join(sorted({d.name or str(d.device) for d in gpus}))
    return Candidate("vmm", 20, f"generic VMM over {kind} on {len(gpus)} device(s): {names}")


#: the built-in generic platform: any CUDA or HIP device, budget from mem-get-info. A free waits for the
#: fence tokens recorded on its range; the device is synchronized after fresh mappings only on devices
#: under WDDM (``page_in_sync="wddm"``: Windows, TCC aside), whose video memory manager pages them in
#: behind the process's back, work no token covers (ComfyUI #16246). Elsewhere nothing pages them in
#: (and Linux cuMemUnmap is itself "synchronous for most use cases", CUDA driver API), so a device-wide
#: sync would only stall every other stream, torch's included.
GENERIC = Platform(
    name="vmm",
    probe=_generic_probe,
    budget_source="auto",  # G3: an integrated device's mem-get-info is MemFree, not what the pool can give
    capabilities=Capabilities(page_in_sync="wddm"),
    # 32 MiB pages, as comfy-aimdo's: on an H200 a fault + copy of 2 MiB pages ran at 0.53x plain pinned copies
    # (a create + map + set-access per page, 67 us, and 38 us to unmap), 32 MiB pages at 1.00x
    page_size=32 * MiB,
    description="generic virtual-memory backend over the CUDA or HIP driver",
)


# --------------------------------------------------------------------------- the headroom in force

#: the ``source`` of a live change (``Session.set_headroom``'s default; the ComfyUI memory panel's VRAM cap): any
#: source that is this or starts with it and a space wins over every other source of the headroom
HEADROOM_LIVE = "live"


class Headroom:
    """The headroom (the bytes every budget keeps free) of one device, and the one precedence that decides it.

    Highest first: (1) a live change, (2) the host's start-up flags (both through :meth:`set`), (3) the
    ``headroom`` setting (``setting``: bytes and where it came from, or None), (4) the backend's own rule
    (``own(device, total) -> (bytes, source)``, or None) and (5) the headroom the backend's budget reports.
    :meth:`in_force` is the only place the precedence is computed. The session makes one per device
    (:class:`HeadroomByDevice`) and hands them to a backend that takes decisions on the headroom itself
    (``hookspec.OptionalMembers.use_headroom``: the VMM backend's budget and its one-pool guard), so the
    backend reads the very object the session changes, and nothing calls back up. Thread-safe: :meth:`set`
    may race :meth:`in_force` from any thread."""

    __slots__ = ("device", "_levels", "_setting", "_own", "_backend", "_lock")
    LIVE, FLAGS = 0, 1  # the levels set through set(), highest first

    def __init__(self, device: Device, *, setting: tuple[int, str] | None = None,
                 own: Callable[[Device, int], tuple[int, str]] | None = None, backend: str = "?"):
        self.device = device
        #: level (LIVE, FLAGS) -> (bytes, source); read and written under _lock
        self._levels: dict[int, tuple[int, str]] = {}
        self._setting = setting
        self._own = own
        self._backend = backend
        self._lock = threading.Lock()

    @classmethod
    def level_of(cls, source: str) -> int:
        """The level ``source`` sets: :data:`HEADROOM_LIVE` (or ``"live ..."``) is live, anything else flags."""
        return cls.LIVE if source == HEADROOM_LIVE or source.startswith(HEADROOM_LIVE + " ") else cls.FLAGS

    def set(self, headroom: int | None, source: str) -> None:
        """Hold ``headroom`` bytes (checked by the caller) at the level of ``source``; None takes it away."""
        level = self.level_of(source)
        with self._lock:
            if headroom is None:
                self._levels.pop(level, None)
            else:
                self._levels[level] = (headroom, source)

    def chosen(self, flags: bool = True) -> tuple[int, str] | None:
        """Levels 1-3 (a live change, the flags unless ``flags`` is false, the setting); None: none is set."""
        with self._lock:
            levels = self._levels
            if levels:
                if flags or self.FLAGS not in levels:
                    return levels[min(levels)]
                if self.LIVE in levels:
                    return levels[self.LIVE]
        return self._setting

    def in_force(self, total: int, reported: int = 0, *, flags: bool = True) -> tuple[int, str]:
        """``(bytes kept free, where they come from, in words)`` on the device of ``total`` bytes whose budget
        ``reported`` a headroom: the one precedence. ``flags`` false leaves the host's start-up flags out (what
        the host is told is free: it accounts for its own flags itself)."""
        chosen = self.chosen(flags)
        if chosen is not None:
            return chosen
        if self._own is not None:
            room, source = self._own(self.device, total)
            return int(room), str(source)
        return reported, f"backend {self._backend}'s own rule (the headroom its budget reports)"


class HeadroomByDevice(dict[Device, Headroom]):
    """Device -> its :class:`Headroom`, made on first ask with ``make(device)`` (a dict: one lookup for a
    backend's budget). Thread-safe: two threads asking at once get the same object."""

    def __init__(self, make: Callable[[Device], Headroom]):
        super().__init__()
        self._make = make
        #: whether a backend reads this table now (its session handed it down and no later session replaced it)
        self.followed = False

    def __missing__(self, device: Device) -> Headroom:
        made: Headroom = self.setdefault(device, self._make(device))
        return made
