"""Host-memory facts: RAM, the memory cgroup's limit, the OS page size.

A small leaf module so that both :mod:`membackend._machine` (hardware facts)
and the host backend (its budget) read host memory the same way, and no
backend has to import ``machine``. It depends on nothing in membackend.

One pool, two ceilings: ``MemAvailable`` (the kernel's estimate of what can
be allocated without swapping, read through psutil) and, inside a container,
what the memory cgroup can still give: its limit minus its non-reclaimable
use, as ComfyUI budgets it (Comfy-Org/ComfyUI #15927). The cgroup's usage
counts the page cache of the files it read (the model checkpoints ComfyUI
just loaded); the inactive part of that cache is given back before the cgroup
runs out, so it is subtracted from the usage, not counted as used.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import psutil

__all__ = ["HostMemory", "CgroupMemory", "read_cgroup", "cgroup_memory", "host_memory", "os_page_size",
           "CGROUP_ROOT"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: cgroup v1 writes "no limit" as a huge page-aligned number (e.g. 2**63 - 4096)
_UNLIMITED = 1 << 60


class _Layout(NamedTuple):
    """Where one cgroup version keeps its figures, relative to the cgroup root."""

    version: str
    limit: Path
    usage: Path
    stat: Path
    inactive_keys: tuple[str, ...]  # the memory.stat lines of the reclaimable file cache, preferred first


#: Kernel docs: cgroup v2 (admin-guide/cgroup-v2.rst) has ``memory.max``, ``memory.current`` and an
#: ``inactive_file N`` line in ``memory.stat``; cgroup v1 (admin-guide/cgroup-v1/memory.rst) has
#: ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and in its ``memory.stat`` both
#: ``total_inactive_file`` (hierarchical, as ``memory.usage_in_bytes`` is) and ``inactive_file`` (this
#: cgroup alone), so v1 prefers the first.
_LAYOUTS = {
    "v2": _Layout("v2", Path("memory.max"), Path("memory.current"), Path("memory.stat"), ("inactive_file",)),
    "v1": _Layout("v1", Path("memory/memory.limit_in_bytes"), Path("memory/memory.usage_in_bytes"),
                  Path("memory/memory.stat"), ("total_inactive_file", "inactive_file")),
}


def os_page_size() -> int:
    """The OS page size in bytes (4 KiB on x86-64 Linux and Windows, 16 KiB on Apple silicon)."""
    return mmap.PAGESIZE


@dataclass(frozen=True)
class CgroupMemory:
    """One reading of this process's memory cgroup (``version`` "v2" or "v1").

    ``limit`` is None where there is none ("max", v1's huge number, or an
    unparsable limit file); ``usage`` is None where the usage file could not
    be read; ``inactive_file`` (bytes of file cache the cgroup can reclaim) is
    None where ``memory.stat`` could not give it. ``inactive_source`` says
    which ``memory.stat`` line gave it, or why none did.
    """

    version: str
    limit: int | None
    usage: int | None
    inactive_file: int | None
    inactive_source: str

    @property
    def non_reclaimable(self) -> int:
        """What the cgroup uses and cannot give back: ``max(0, usage - inactive_file)``; the whole usage
        where ``inactive_file`` is unknown, 0 where the usage is."""
        return max(0, (self.usage or 0) - (self.inactive_file or 0))

    @property
    def room(self) -> int | None:
        """What the cgroup can still give: ``max(0, limit - non_reclaimable)``; None without a limit."""
        return None if self.limit is None else max(0, self.limit - self.non_reclaimable)

    def describe(self) -> str:
        """Where :attr:`room` comes from, in words for the doctor: which files, and what was subtracted."""
        layout = _LAYOUTS[self.version]
        head, usage_file = f"cgroup {self.version} {layout.limit.name}", layout.usage.name
        if self.limit is None:
            return f"{head}: no limit"
        if self.usage is None:
            return f"{head}, nothing subtracted ({usage_file} could not be read)"
        if self.inactive_file is None:
            return f"{head} - the whole {usage_file} ({self.inactive_source}: its file cache counted as used)"
        return f"{head} - ({usage_file} - {self.inactive_source})"


def _read(path: Path) -> str | None:
    """The text of ``path``; None where it cannot be read or is not text (never raises)."""
    try:
        return path.read_text()
    except (OSError, ValueError):  # ValueError: UnicodeDecodeError, bytes that are not text
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _inactive_file(path: Path, keys: tuple[str, ...]) -> tuple[int | None, str]:
    """The first of ``keys`` found in the ``memory.stat`` at ``path``: (bytes, "KEY of memory.stat"), or
    (None, why there is no figure). Never raises."""
    try:
        text = path.read_text()
    except (OSError, ValueError) as exc:
        return None, f"{path.name} could not be read ({type(exc).__name__})"
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.strip().partition(" ")
        found.setdefault(name, value.strip())
    for key in keys:
        if key in found:
            size = _int(found[key])
            if size is None or size < 0:
                return None, f"{path.name} has {key} {found[key][:40]!r}, not a byte count"
            return size, f"{key} of {path.name}"
    return None, f"{path.name} has no {' or '.join(keys)} line"


def read_cgroup(root: Path = CGROUP_ROOT) -> CgroupMemory | None:
    """This process's memory cgroup under ``root`` (cgroup v2 first, then v1); None where neither
    version's limit file can be read (no cgroup, or not Linux). Never raises: an unreadable or unparsable
    file counts as absent, and an unusable ``memory.stat`` leaves ``inactive_file`` None (the whole usage
    is then subtracted)."""
    for layout in _LAYOUTS.values():
        raw = _read(root / layout.limit)
        if raw is None:
            continue
        limit = None if raw.strip() == "max" else _int(raw)
        if limit is not None and limit >= _UNLIMITED:
            limit = None
        usage = _int(_read(root / layout.usage))
        inactive, inactive_source = _inactive_file(root / layout.stat, layout.inactive_keys)
        return CgroupMemory(layout.version, limit, usage, inactive, inactive_source)
    return None


def cgroup_memory(root: Path = CGROUP_ROOT) -> tuple[int | None, int | None]:
    """(limit, usage) of :func:`read_cgroup`: ``None`` where there is no limit, ``(None, None)`` where
    there is no cgroup to read. The usage here is the whole usage, file cache included."""
    reading = read_cgroup(root)
    return (None, None) if reading is None else (reading.limit, reading.usage)


@dataclass(frozen=True)
class HostMemory:
    """Host RAM as one pool: ``total`` and ``available`` bytes, and where they came from.

    ``ram_total``/``ram_available`` are the machine's own figures;
    ``cgroup_limit`` is None outside a limiting cgroup. ``total``/``available``
    are the ceilings that apply to this process (the smaller of the two sources).
    ``cgroup`` is the memory cgroup as read (None where there is none, or the
    figures are not this machine's); its :meth:`CgroupMemory.describe` names
    the source of the cgroup's part of ``available``.
    """

    total: int
    available: int
    source: str
    ram_total: int
    ram_available: int
    cgroup_limit: int | None
    cgroup: CgroupMemory | None = None


def host_memory(root: Path = CGROUP_ROOT) -> HostMemory:
    """Read RAM (psutil: ``MemAvailable`` on Linux) and cap it by the memory cgroup under ``root``.

    Inside a cgroup whose limit is below the RAM, ``total`` is the limit and ``available`` is
    ``max(0, min(MemAvailable, limit - (usage - inactive_file)))`` (:attr:`CgroupMemory.room`).
    """
    vm = psutil.virtual_memory()
    ram_total, ram_available = int(vm.total), int(vm.available)
    total, available, source = ram_total, ram_available, "psutil MemAvailable"
    cgroup = read_cgroup(root)
    limit = cgroup.limit if cgroup is not None else None
    if cgroup is not None and cgroup.limit is not None and cgroup.limit < total:  # one at or above RAM caps nothing
        total, source = cgroup.limit, "cgroup memory limit"
        available = max(0, min(available, cgroup.limit - cgroup.non_reclaimable))
    return HostMemory(total, available, source, ram_total, ram_available, limit, cgroup)


def process_private_bytes() -> int | None:
    """This process's private committed bytes on Windows (psutil's ``private``, the figure Task
    Manager and ComfyUI #15993 report); None elsewhere, where no such commit charge exists."""
    info = psutil.Process().memory_info()
    private = getattr(info, "private", None)
    return int(private) if private is not None else None
