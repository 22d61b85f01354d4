"""Host-memory facts: RAM, the memory cgroup's limit, the OS page size.

A small leaf module so that both :mod:`membackend._machine` (hardware facts)
and the host backend (its budget) read host memory the same way, and no
backend has to import ``machine``. It depends on nothing in membackend.

One pool, two ceilings: ``MemAvailable`` (the kernel's estimate of what can
be allocated without swapping, read through psutil) and, inside a container,
the memory cgroup's limit minus what the cgroup already uses.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["HostMemory", "cgroup_memory", "host_memory", "os_page_size", "CGROUP_ROOT"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: cgroup v1 writes "no limit" as a huge page-aligned number (e.g. 2**63 - 4096)
_UNLIMITED = 1 << 60


def os_page_size() -> int:
    """The OS page size in bytes (4 KiB on x86-64 Linux and Windows, 16 KiB on Apple silicon)."""
    return mmap.PAGESIZE


def cgroup_memory(root: Path = CGROUP_ROOT) -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup; ``None`` where there is no limit.

    cgroup v2 exposes ``memory.max``/``memory.current`` (kernel docs,
    admin-guide/cgroup-v2.rst); v1 ``memory/memory.limit_in_bytes`` and
    ``memory.usage_in_bytes`` (admin-guide/cgroup-v1/memory.rst). Unreadable
    or unparsable files count as absent: the answer is then ``(None, None)``.
    """
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            raw = limit_file.read_text().strip()
        except OSError:
            continue
        try:
            usage: int | None = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            usage = None
        if raw == "max":
            return None, usage
        try:
            limit = int(raw)
        except ValueError:
            return None, usage
        return (None if limit >= _UNLIMITED else limit), usage
    return None, None


@dataclass(frozen=True)
class HostMemory:
    """Host RAM as one pool: ``total`` and ``available`` bytes, and where they came from.

    ``ram_total``/``ram_available`` are the machine's own figures;
    ``cgroup_limit`` is None outside a limiting cgroup. ``total``/``available``
    are the ceilings that apply to this process (the smaller of the two sources).
    """

    total: int
    available: int
    source: str
    ram_total: int
    ram_available: int
    cgroup_limit: int | None


def host_memory(root: Path = CGROUP_ROOT) -> HostMemory:
    """Read RAM (psutil: ``MemAvailable`` on Linux) and cap it by the memory cgroup under ``root``."""
    vm = psutil.virtual_memory()
    ram_total, ram_available = int(vm.total), int(vm.available)
    total, available, source = ram_total, ram_available, "psutil MemAvailable"
    limit, usage = cgroup_memory(root)
    if limit is not None and limit < total:
        total, source = limit, "cgroup memory limit"
        available = max(0, min(available, limit - (usage or 0)))
    return HostMemory(total, available, source, ram_total, ram_available, limit)


def process_private_bytes() -> int | None:
    """This process's private committed bytes on Windows (psutil's ``private``, the figure Task
    Manager and ComfyUI #15993 report); None elsewhere, where no such commit charge exists."""
    info = psutil.Process().memory_info()
    private = getattr(info, "private", None)
    return int(private) if private is not None else None
