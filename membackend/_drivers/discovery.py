"""Machine facts from the drivers' own discovery calls, before torch and without initialising it.

:func:`discover` asks, in this order, and records where every fact came from:

* the **host** (OS, CPUs, the installed torch build from its metadata; RAM and
  the cgroup limit per call through :func:`host.memory`);
* **CUDA** through :class:`~membackend._drivers.cuda.CudaDriver`: ``cuInit``,
  ``cuDeviceGetCount``, ``cuDriverGetVersion``, and per device ``cuDeviceGet``,
  ``cuDeviceGetName``, ``cuDeviceTotalMem``, ``cuDeviceGetAttribute`` for compute
  capability (75, 76), integrated (18), virtual memory management support
  (102), on Windows the driver model (TCC_DRIVER, 35) and ``cuDeviceGetLuid``;
  the PCI location (50, 33, 34) only to match NVML's devices. No context is
  created; the driver lists only what ``CUDA_VISIBLE_DEVICES`` leaves visible
  (it reads the variable once, at ``cuInit``);
* **NVML** where ``pynvml`` (nvidia-ml-py) imports and answers: it fills in
  what CUDA did not answer (a device's memory, the Windows driver model) and
  lists devices only when the CUDA driver API did not answer at all; every
  NVML error is "no answer" (GB10's ``nvmlDeviceGetMemoryInfo`` raises);
* **HIP**, through each binding given in turn until one loads its runtime
  (hip-python, then the ctypes binding of the runtime torch's ROCm build
  ships): ``hipInit``, ``hipGetDeviceCount``, ``hipDriverGetVersion``, per device
  ``hipGetDeviceProperties`` (name, total memory, ``gcnArchName``, integrated,
  LUID) and ``hipDeviceGetAttribute`` (virtual memory management support);
* ``/proc/driver/nvidia/gpus`` last, for names only, when nothing else listed an
  NVIDIA device.

(:func:`membackend._drivers.open.discovery_for` imports a binding only where the
driver library it loads by name is present.) A binding that fails lists no device and leaves a line in
``Machine.discovery`` saying why; :func:`discover` never raises. The
simulated drivers answer the same calls from a profile, so the same code runs
on them (:func:`membackend._drivers.open.discovery_for`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .._hostmem import HostMemory, host_memory
from ..types import Device, DeviceInfo, DriverError, Machine

if TYPE_CHECKING:  # naming the pydantic model at import would build it
    from .._settings import MachineOverrides
    from .gpu import GpuDriver

log = logging.getLogger(__name__)

__all__ = ["Bindings", "Discovered", "RealHost", "discover", "assemble", "apply_overrides", "torch_build",
           "torch_vendor_of", "visible_ordinals", "format_luid"]


# --------------------------------------------------------------------------- the host


def torch_vendor_of(version: str) -> str | None:
    """``cuda``/``rocm``/``cpu`` from a torch version's local label (``2.13.0+cu130``), else None."""
    local = version.partition("+")[2]
    for prefix, vendor in (("cu", "cuda"), ("rocm", "rocm"), ("cpu", "cpu")):
        if local.startswith(prefix):
            return vendor
    return None


def torch_build() -> tuple[str | None, str | None]:
    """(version, vendor) of the installed torch, without importing it.

    The local version label tells the build (``2.13.0+cpu``, ``+cu128``,
    ``+rocm6.4``); where there is none, ``torch/version.py`` says whether
    ``cuda`` or ``hip`` is set.
    """
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None, None
    vendor = torch_vendor_of(version)
    if vendor:
        return version, vendor
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        try:
            text = (Path(spec.origin).parent / "version.py").read_text()
        except OSError:
            text = ""
        if re.search(r"^hip\s*[:=].*['\"]\d", text, re.M):
            return version, "rocm"
        if re.search(r"^cuda\s*[:=].*['\"]\d", text, re.M):
            return version, "cuda"
        if text:
            return version, "cpu"
    return version, None


class RealHost:
    """This machine: ``platform.system()``, ``os.cpu_count()``, torch's metadata, ``hostmem``."""

    label = "this machine"

    def os_name(self) -> tuple[str, str]:
        return platform.system().lower(), "platform.system()"

    def cpus(self) -> tuple[int, str]:
        return os.cpu_count() or 1, "os.cpu_count()"

    def torch(self) -> tuple[str | None, str | None, str]:
        version, vendor = torch_build()
        return version, vendor, "torch's installed metadata (not imported)"

    def memory(self) -> HostMemory:
        return host_memory()


# --------------------------------------------------------------------------- what to ask


@dataclass(frozen=True)
class Bindings:
    """What :func:`discover` asks: a host, a CUDA opener, HIP openers tried in order, whether to ask
    NVML and ``/proc/driver/nvidia``. An opener returns a driver wrapper (not initialised) or raises
    ``ImportError`` / ``DriverError`` saying why there is none."""

    host: Any
    cuda: Callable[[], "GpuDriver"] | None = None
    hip: Sequence[Callable[[], "GpuDriver"]] = ()
    nvml: bool = False
    proc_nvidia: bool = False
    environ: Mapping[str, str] = field(default_factory=dict)  # for the visibility note only


@dataclass(frozen=True)
class Discovered:
    """The stable part of the machine: everything but RAM figures, which :func:`assemble` reads per call."""

    os: str
    cpus: int
    torch_version: str | None
    torch_vendor: str | None
    devices: tuple[DeviceInfo, ...]
    sources: tuple[tuple[str, str], ...]
    discovery: tuple[str, ...]


def visible_ordinals(count: int, vendor: str, environ: Mapping[str, str]) -> list[int]:
    """The ordinals (of ``count`` physical devices) a driver lists under ``environ``'s
    ``CUDA_VISIBLE_DEVICES`` (CUDA) or ``HIP_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES`` (HIP):
    the comma-separated ordinals up to the first that is not a valid, unrepeated one (CUDA C
    Programming Guide, "CUDA Environment Variables"; ROCm's HIP_VISIBLE_DEVICES). UUID entries are
    not modelled: they end the list here."""
    names = ("CUDA_VISIBLE_DEVICES",) if vendor == "cuda" else ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    raw = next((environ[n] for n in names if n in environ), None)
    if raw is None:
        return list(range(count))
    found: list[int] = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= count or int(item) in found:
            break
        found.append(int(item))
    return found


def format_luid(luid: tuple[int, int]) -> str:
    """(LowPart, HighPart) → 16 hex digits, HighPart first."""
    low, high = luid
    return f"{high & 0xFFFFFFFF:08x}{low & 0xFFFFFFFF:08x}"


def _version_text(vendor: str, v: int) -> str:
    if vendor == "cuda":  # 1000 x major + 10 x minor
        return f"{v // 1000}.{v % 1000 // 10}"
    return f"{v // 10_000_000}.{v // 100_000 % 100}.{v % 100_000}"  # HIP_VERSION encoding


class _Facts:
    """One device's answers, each with its source; failures collected for the discovery line."""

    def __init__(self, vendor: str, index: int):
        self.vendor, self.index = vendor, index
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.failed: list[str] = []

    def ask(self, name: str, what: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except Exception as exc:  # a driver error, or a binding without that name: this fact only
            self.failed.append(f"{name} ({exc})" if isinstance(exc, DriverError) else
                               f"{name} ({type(exc).__name__}: {exc})")
            return None
        self.values[name] = value
        self.sources[name] = f"{self.vendor}: {what}"
        return value

    def device(self, label: str) -> DeviceInfo:
        if "integrated" in self.values:
            self.values["unified"] = self.values["integrated"]
            self.sources["unified"] = "derived: integrated"
        kind = "hip" if self.vendor == "hip" else "cuda"
        return DeviceInfo(Device(kind, self.index), source=label, sources=tuple(self.sources.items()), **self.values)


def _cuda(opener: Callable[[], Any], os_name: str, nvml: list[dict] | None) -> tuple[list[DeviceInfo], list[str]]:
    try:
        d = opener()
    except (ImportError, DriverError) as exc:
        return [], [f"cuda: {exc}"]
    where = f"cuda ({d.label})"
    try:
        d.init()
        count = d.device_count()
    except DriverError as exc:
        return [], [f"{where}: no answer ({exc})"]
    try:
        version = f", driver {_version_text('cuda', d.driver_version())} (cuDriverGetVersion)"
    except DriverError:
        version = ""
    devices, notes = [], []
    for i in range(count):
        f = _Facts("cuda", i)
        f.ask("name", "cuDeviceGetName", lambda: d.name(i))
        f.ask("total_memory", "cuDeviceTotalMem", lambda: d.total_mem(i))
        f.ask("arch", "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR, _MINOR)", lambda: d.arch(i))
        f.ask("integrated", "cuDeviceGetAttribute(INTEGRATED)", lambda: d.integrated(i))
        f.ask("vmm_supported", "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", lambda: d.vmm_supported(i))
        if os_name == "windows":
            f.ask("driver_model", "cuDeviceGetAttribute(TCC_DRIVER)", lambda: d.driver_model(i, os_name))
            f.ask("luid", "cuDeviceGetLuid", lambda: format_luid(d.luid(i)))
        if nvml:
            _fill_from_nvml(f, d, nvml, os_name)
        if f.failed:
            notes.append(f"{where}: cuda:{i} did not answer for " + "; ".join(f.failed))
        devices.append(f.device(d.label))
    try:
        d.close()
    except DriverError:
        pass
    memory = d.memory_note()
    return devices, [f"{where}: {count} device(s){version}"] + ([f"{where}: {memory}"] if memory else []) + notes


def _fill_from_nvml(f: _Facts, d: Any, nvml: list[dict], os_name: str) -> None:
    """What NVML knows of the same board (matched by PCI location) fills what CUDA did not answer."""
    try:
        where = d.pci_location(f.index)
    except DriverError:
        return
    match = next((n for n in nvml if n.get("pci") == where), None)
    if match is None:
        return
    for name, call in (("name", "nvmlDeviceGetName"), ("total_memory", "nvmlDeviceGetMemoryInfo"),
                       ("driver_model", "nvmlDeviceGetDriverModel")):
        if name not in f.values and match.get(name) is not None and (name != "driver_model" or os_name == "windows"):
            f.values[name] = match[name]
            f.sources[name] = f"nvml: {call}"


def _nvml(os_name: str) -> tuple[list[dict], list[str]]:
    """NVML's devices as plain records (name, total_memory, driver_model, pci); errors are no answer."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return [], ["nvml: not asked (nvidia-ml-py is not installed; optional)"]
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return [], [f"nvml: no answer ({type(exc).__name__}: {exc})"]
    found: list[dict] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            rec: dict[str, Any] = {}
            for key, fn in (("name", lambda: pynvml.nvmlDeviceGetName(h)),
                            ("total_memory", lambda: int(pynvml.nvmlDeviceGetMemoryInfo(h).total)),
                            ("pci", lambda: _nvml_pci(pynvml.nvmlDeviceGetPciInfo(h)))):
                try:
                    rec[key] = fn()
                except Exception:
                    pass  # e.g. GB10: memory info is unsupported
            if isinstance(rec.get("name"), bytes):
                rec["name"] = rec["name"].decode(errors="replace")
            if os_name == "windows":
                try:
                    rec["driver_model"] = "wddm" if pynvml.nvmlDeviceGetDriverModel(h)[0] == pynvml.NVML_DRIVER_WDDM \
                        else "tcc"
                except Exception:
                    pass
            found.append(rec)
    except Exception as exc:
        return found, [f"nvml: listing stopped ({type(exc).__name__}: {exc})"]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return found, [f"nvml: {len(found)} device(s)"]


def _nvml_pci(info: Any) -> tuple[int, int, int]:
    return int(info.domain), int(info.bus), int(info.device)


def _hip(openers: Sequence[Callable[[], Any]], os_name: str) -> tuple[list[DeviceInfo], list[str]]:
    notes: list[str] = []
    for opener in openers:
        try:
            d = opener()
        except (ImportError, DriverError) as exc:
            if isinstance(exc, DriverError) and exc.call == "dlopen":
                # every binding asks the loader for the same runtime: say it once, with the last (fullest) answer
                notes = [n for n in notes if not n.startswith("hip: dlopen failed")]
            notes.append(f"hip: {exc}")
            continue
        where = f"hip ({d.label})"
        try:
            d.init()
        except DriverError as exc:
            notes.append(f"{where}: {exc}")
            if exc.code == "unavailable":
                continue  # this binding cannot load a runtime: try the next
            return [], notes
        try:
            count = d.device_count()
        except DriverError as exc:
            return [], notes + [f"{where}: no devices ({exc})"]
        try:
            version = f", runtime {_version_text('hip', d.driver_version())} (hipDriverGetVersion)"
        except DriverError:
            version = ""
        devices, problems = [], []
        for i in range(count):
            f = _Facts("hip", i)
            props = f.ask("_props", "hipGetDeviceProperties", lambda: d.properties(i))
            f.values.pop("_props", None)
            f.sources.pop("_props", None)
            if props is not None:
                for name, member in (("name", "name"), ("total_memory", "totalGlobalMem"), ("arch", "gcnArchName"),
                                     ("integrated", "integrated")):
                    f.values[name] = getattr(props, name)
                    f.sources[name] = f"hip: hipGetDeviceProperties(.{member})"
                if os_name == "windows" and any(props.luid):
                    f.values["luid"] = format_luid((int.from_bytes(props.luid[:4], "little"),
                                                    int.from_bytes(props.luid[4:8], "little", signed=True)))
                    f.sources["luid"] = "hip: hipGetDeviceProperties(.luid)"
            else:
                f.ask("name", "hipDeviceGetName", lambda: d.name(i))
                f.ask("total_memory", "hipDeviceTotalMem", lambda: d.total_mem(i))
                f.ask("integrated", "hipDeviceGetAttribute(Integrated)", lambda: d.integrated(i))
            f.ask("vmm_supported", "hipDeviceGetAttribute(VirtualMemoryManagementSupported)", lambda: d.vmm_supported(i))
            if f.failed:
                problems.append(f"{where}: hip:{i} did not answer for " + "; ".join(f.failed))
            devices.append(f.device(d.label))
        memory = d.memory_note()
        return devices, notes + [f"{where}: {count} device(s){version}"] + ([f"{where}: {memory}"] if memory else []) \
            + problems
    return [], notes


def _proc_nvidia(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[DeviceInfo]:
    """The Linux NVIDIA driver lists each GPU's model here (no memory size, no attributes)."""
    found = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for i, entry in enumerate(entries):
        name = ""
        try:
            for line in (entry / "information").read_text().splitlines():
                if line.startswith("Model:"):
                    name = line.split(":", 1)[1].strip()
        except OSError:
            pass
        found.append(DeviceInfo(Device("cuda", i), name, 0, source="/proc/driver/nvidia",
                                sources=(("name", f"/proc/driver/nvidia/gpus/{entry.name}/information"),)))
    return found


# --------------------------------------------------------------------------- putting it together


def discover(bindings: Bindings) -> Discovered:
    """Ask everything ``bindings`` names (see the module docstring); never raises."""
    host = bindings.host
    os_name, os_source = host.os_name()
    cpus, cpus_source = host.cpus()
    torch_version, torch_vendor, torch_source = host.torch()
    notes: list[str] = []
    nvml_devices: list[dict] = []
    if bindings.nvml:
        nvml_devices, more = _nvml(os_name)
        notes += more
    cuda: list[DeviceInfo] = []
    cuda_opener = bindings.cuda
    if cuda_opener is not None:
        cuda, more = _guarded(lambda: _cuda(cuda_opener, os_name, nvml_devices), "cuda")
        notes += more
    if not cuda and nvml_devices:
        cuda = [DeviceInfo(Device("cuda", i), n.get("name", ""), n.get("total_memory", 0),
                           driver_model=n.get("driver_model"), source="nvml",
                           sources=tuple((k, f"nvml ({k})") for k in ("name", "total_memory", "driver_model")
                                         if n.get(k) is not None))
                for i, n in enumerate(nvml_devices)]
        notes.append("nvml: listed the NVIDIA devices because the CUDA driver API did not answer (NVML's order, "
                     "which CUDA_VISIBLE_DEVICES does not change; virtual memory management support unknown)")
    if not cuda and bindings.proc_nvidia:
        cuda = _proc_nvidia()
        if cuda:
            notes.append("/proc/driver/nvidia: names only (no memory, no attributes)")
    hip: list[DeviceInfo] = []
    if bindings.hip:
        hip, more = _guarded(lambda: _hip(bindings.hip, os_name), "hip")
        notes += more
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if var in bindings.environ:
            notes.append(f"{var}={bindings.environ[var]!r}: the drivers list only the devices it leaves visible")
    sources = (("os", os_source), ("cpus", cpus_source), ("torch_version", torch_source),
               ("torch_vendor", torch_source))
    return Discovered(os_name, cpus, torch_version, torch_vendor, tuple(cuda + hip), sources, tuple(notes))


def _guarded(fn: Callable[[], tuple[list, list]], vendor: str) -> tuple[list, list]:
    """A binding that breaks in a way nobody foresaw lists nothing and says so (G6)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - discovery never raises out of gather_machine
        log.debug("membackend: %s discovery failed", vendor, exc_info=True)
        return [], [f"{vendor}: discovery failed ({type(exc).__name__}: {exc})"]


def assemble(found: Discovered, memory: HostMemory) -> Machine:
    """The :class:`Machine` of ``found`` with the RAM figures of ``memory``."""
    ram_source = f"hostmem: {memory.source}"
    sources = found.sources + (("ram_total", ram_source), ("ram_available", ram_source),
                               ("cgroup_limit", _cgroup_source(memory)))
    return Machine(os=found.os, cpus=found.cpus, ram_total=memory.ram_total, ram_available=memory.ram_available,
                   cgroup_limit=memory.cgroup_limit, torch_version=found.torch_version,
                   torch_vendor=found.torch_vendor, devices=found.devices, sources=sources,
                   discovery=found.discovery)


def _cgroup_source(memory: HostMemory) -> str:
    """Where the cgroup limit, and what the cgroup can still give, come from: the files read and what was
    subtracted from the limit (the usage less its reclaimable file cache, or the whole usage and why)."""
    if memory.cgroup_limit is None:
        return "hostmem: no cgroup limit"
    if memory.cgroup is None:  # figures not read from this machine's cgroup files
        return "hostmem: memory cgroup limit"
    caps = "" if memory.cgroup_limit < memory.ram_total else " (at or above the RAM: it caps nothing)"
    return f"hostmem: {memory.cgroup.describe()}{caps}"


def _override_source(name: str) -> str:
    return f"user override MEMBACKEND_MACHINE__{name.upper()} (or machine.{name} in the settings)"


def apply_overrides(machine: Machine, overrides: "MachineOverrides | None") -> Machine:
    """``machine`` with every field the user's ``overrides`` set replaced, and sourced as such."""
    if overrides is None:
        return machine
    changes = {k: v for k, v in overrides.model_dump(exclude={"devices"}).items() if v is not None}
    if overrides.devices is not None:
        fields = ("name", "total_memory", "integrated", "unified", "driver_model", "arch", "vmm_supported", "luid")
        src = _override_source("devices")
        changes["devices"] = tuple(
            DeviceInfo(Device(d.kind, d.index), d.name, d.total_memory, d.integrated, d.unified or d.integrated,
                       d.driver_model, d.arch, source="override", vmm_supported=d.vmm_supported, luid=d.luid,
                       sources=tuple((f, src) for f in fields))
            for d in overrides.devices
        )
    if not changes:
        return machine
    sources = dict(machine.sources)
    sources.update({k: _override_source(k) for k in changes if k != "devices"})
    return replace(machine, **changes, overridden=tuple(sorted(changes)), sources=tuple(sources.items()))
