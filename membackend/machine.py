"""Hardware facts, gathered once and cheaply.

Nothing here creates a GPU context or imports torch: the torch build is read
from its installed metadata, GPUs are listed from NVML (if ``pynvml`` is
installed), ``/proc/driver/nvidia`` or an already initialised torch. Every
fact can be overridden from :class:`~membackend.settings.MachineOverrides`.
RAM and the cgroup limit come from :mod:`membackend.hostmem`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import platform
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .hostmem import host_memory
from .types import Device, DeviceInfo, Machine

if TYPE_CHECKING:  # naming the pydantic model at import would build it: start-up stays free of pydantic
    from .settings import MachineOverrides

log = logging.getLogger(__name__)

__all__ = ["gather_machine", "torch_build"]


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
    local = version.partition("+")[2]
    if local.startswith("cu"):
        return version, "cuda"
    if local.startswith("rocm"):
        return version, "rocm"
    if local.startswith("cpu"):
        return version, "cpu"
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


def _nvml_devices() -> list[DeviceInfo]:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVML absent or no driver: nothing to list
        log.debug("NVML unavailable: %s", exc)
        return []
    found = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            total = pynvml.nvmlDeviceGetMemoryInfo(h).total
            driver_model = None
            if sys.platform == "win32":
                try:
                    current = pynvml.nvmlDeviceGetDriverModel(h)[0]
                    driver_model = "wddm" if current == pynvml.NVML_DRIVER_WDDM else "tcc"
                except Exception:
                    pass
            found.append(DeviceInfo(Device("cuda", i), name, int(total), driver_model=driver_model, source="nvml"))
    except Exception as exc:
        log.debug("NVML listing failed: %s", exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return found


def _proc_nvidia_devices(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[DeviceInfo]:
    """The Linux NVIDIA driver lists each GPU's model here (no memory size)."""
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
        found.append(DeviceInfo(Device("cuda", i), name, 0, source="/proc/driver/nvidia"))
    return found


def _torch_devices() -> list[DeviceInfo]:
    """Only if torch is imported and CUDA/HIP already initialised: asking would create a context."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:
        if not torch.cuda.is_initialized():
            return []
        kind = "hip" if getattr(torch.version, "hip", None) else "cuda"
        found = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            arch = getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"
            found.append(
                DeviceInfo(Device(kind, i), p.name, int(p.total_memory), integrated=bool(getattr(p, "is_integrated", False)),
                           unified=bool(getattr(p, "is_integrated", False)), arch=arch, source="torch")
            )
        return found
    except Exception as exc:
        log.debug("torch device listing failed: %s", exc)
        return []


@functools.lru_cache(maxsize=1)
def _detected_static() -> tuple:
    """Facts that do not change while the process runs (devices, OS, torch build)."""
    system = platform.system().lower()
    version, vendor = torch_build()
    devices = _torch_devices() or _nvml_devices() or _proc_nvidia_devices()
    return system, os.cpu_count() or 1, version, vendor, tuple(devices)


def gather_machine(overrides: MachineOverrides | None = None) -> Machine:
    """Detect this machine (cached where stable) and apply ``overrides``."""
    system, cpus, version, vendor, devices = _detected_static()
    mem = host_memory()
    machine = Machine(
        os=system, cpus=cpus, ram_total=mem.ram_total, ram_available=mem.ram_available,
        cgroup_limit=mem.cgroup_limit, torch_version=version, torch_vendor=vendor, devices=devices,
    )
    if overrides is None:
        return machine
    changes = {k: v for k, v in overrides.model_dump(exclude={"devices"}).items() if v is not None}
    if overrides.devices is not None:
        changes["devices"] = tuple(
            DeviceInfo(Device(d.kind, d.index), d.name, d.total_memory, d.integrated, d.unified or d.integrated,
                       d.driver_model, d.arch, source="override")
            for d in overrides.devices
        )
    if not changes:
        return machine
    return replace(machine, **changes, overridden=tuple(sorted(changes)))
