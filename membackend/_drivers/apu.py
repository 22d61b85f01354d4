"""One pool on an AMD APU: three figures of what is left, none to trust alone, and the smallest of them.

On an AMD APU (Strix Halo, gfx1151) the GPU has no memory of its own: a small
BIOS carve-out shows as VRAM, the rest it uses is GTT, system memory the
amdgpu driver maps for it (sysfs ``mem_info_gtt_total`` is ``ttm.pages_limit``
x 4096); device pages, host copies and everything else the system runs draw
from one pool. The figures that describe it disagree (public reports,
membackend issue 27):

* ``hipMemGetInfo`` reported free 120.00 GiB above its own total of
  62.47 GiB on one HIP version, and a total of the carve-out alone on
  another: its free is never taken above its total (a free above it is no
  free at all: the total less what sysfs says is in use is taken instead),
  and a figure whose total is the carve-out alone describes the carve-out,
  not the pool: it is shown and left out;
* sysfs says what the carve-out and the GTT leave
  (``mem_info_{vram,gtt}_{total,used}``, Linux amdgpu documentation), but
  knows nothing of the host's own use of the same memory;
* ``MemAvailable`` knows the host's use, but replacing ``hipMemGetInfo`` by it
  lost about 6 GiB; and GTT allocations are not charged to a memory cgroup
  (hipMalloc is not limited by one), so the machine's own ``MemAvailable`` is
  read, not the cgroup's view. A reserve is kept from it for the system.

The budget is the smallest of the three (:func:`apu_pool`), and its source
line names all three and the one that bound, for ``membackend doctor`` and
the memory panel. This module reads files and does arithmetic only; the driver
wrappers call it (:meth:`membackend._drivers.gpu.GpuDriver.budget`).

The sysfs files are read as regular files only (a FIFO or a device put in their
place is never read: nothing blocks, nothing is read without end), at most
:data:`MAX_FILE_BYTES` of each, and a value is taken only as a byte count of at
most :data:`MAX_DIGITS` digits, with each total above zero and at most the
machine's memory. A bad file is logged once, and the budget is then made of the
other two figures, as when the files are missing.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..types import format_size

__all__ = ["AmdgpuMemory", "ApuFigure", "ApuPool", "SYSFS_ENV", "apu_pool", "read_amdgpu_memory", "sysfs_root",
           "system_reserve"]

GiB = 1 << 30
log = logging.getLogger(__name__)
#: the most of one sysfs memory file read: a 64-bit byte count in decimal and a newline fit with room to spare
MAX_FILE_BYTES = 64
#: the most digits of a value taken: 2**64 - 1 has 20
MAX_DIGITS = 20
#: AMD's Variable Graphics Memory lets the firmware give the GPU at most 75% of the RAM as its carve-out, which
#: the kernel then does not count: the machine's memory is at most four times what the kernel (``MemTotal``) or
#: the driver (its mem-get-info total: the carve-out, or the GTT) counts of it
MACHINE_PER_COUNT = 4
_reported: set[tuple[str, str, str]] = set()  # (folder, file, kind of fault) of every bad file logged once
#: the variable that moves the sysfs root (default ``/sys``): a container that mounts the host's sysfs elsewhere,
#: or a simulated machine whose stand-in driver writes the amdgpu files
SYSFS_ENV = "MEMBACKEND_SYSFS_ROOT"
_FILES = ("mem_info_vram_total", "mem_info_vram_used", "mem_info_gtt_total", "mem_info_gtt_used")


def sysfs_root() -> Path:
    return Path(os.environ.get(SYSFS_ENV) or "/sys")


@dataclass(frozen=True)
class AmdgpuMemory:
    """The amdgpu driver's four memory files of one device (bytes) and the folder they came from."""

    vram_total: int
    vram_used: int
    gtt_total: int
    gtt_used: int
    path: str

    @property
    def total(self) -> int:
        return self.vram_total + self.gtt_total

    @property
    def left(self) -> int:
        """What the carve-out and the GTT leave."""
        return max(0, self.vram_total - self.vram_used) + max(0, self.gtt_total - self.gtt_used)


class _BadFile(ValueError):
    """A sysfs memory file that is there but cannot be taken: ``kind`` says how (``not regular``, ``unreadable``,
    ``too long``, ``not a number``, ``out of range``), the message what it holds and what is accepted."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def read_amdgpu_memory(domain: int, bus: int, device: int, function: int = 0,
                       root: Path | None = None) -> AmdgpuMemory | None:
    """The amdgpu memory files of the PCI function ``domain:bus:device.function`` under ``root``
    (:func:`sysfs_root` by default: ``/sys/bus/pci/devices/0000:c5:00.0/mem_info_*``); None when any of
    them is missing (no amdgpu driver, another vendor, a sandbox without sysfs) or bad (see the module
    docstring; logged once per file). Never blocks and never raises."""
    folder = (root or sysfs_root()) / "bus" / "pci" / "devices" / f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"
    values = []
    for name in _FILES:
        try:
            value = _byte_count(folder / name)
            if value is not None and name.endswith("_total") and value == 0:
                raise _BadFile("out of range", "holds a total of 0 bytes; accepted: a total above zero")
        except _BadFile as exc:
            report_bad_file(str(folder), name, exc.kind, str(exc))
            return None
        if value is None:
            return None
        values.append(value)
    vram_total, vram_used, gtt_total, gtt_used = values
    return AmdgpuMemory(vram_total, vram_used, gtt_total, gtt_used, path=str(folder))


def _byte_count(path: Path) -> int | None:
    """The byte count in the file ``path``; None when it does not exist; ``_BadFile`` for anything else
    than a regular file of at most :data:`MAX_FILE_BYTES` holding at most :data:`MAX_DIGITS` digits."""
    accepted = f"accepted: a regular file holding a byte count of at most {MAX_DIGITS} digits"
    try:
        # stat first, then fstat of what was opened: a FIFO or a device (a link to /dev/zero) is never read;
        # O_NONBLOCK: one put in its place between the two does not block the open
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise _BadFile("not regular", f"is not a regular file (a FIFO, a device or a folder); {accepted}")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _BadFile("not regular", f"is not a regular file (a FIFO, a device or a folder); {accepted}")
            data = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _BadFile("unreadable", f"cannot be read ({exc.strerror or exc}); {accepted}") from None
    if len(data) > MAX_FILE_BYTES:
        raise _BadFile("too long", f"holds more than {MAX_FILE_BYTES} bytes; {accepted}")
    text = data.strip()
    if not text.isdigit() or len(text) > MAX_DIGITS:
        shown = text[:32].decode("ascii", "replace") + ("..." if len(text) > 32 else "")
        raise _BadFile("not a number", f"holds {shown!r}, not a byte count; {accepted}")
    return int(text)


def report_bad_file(folder: str, name: str, kind: str, why: str) -> None:
    """Log a bad sysfs memory file once per folder, file and ``kind`` of fault, saying the budget goes on
    without it."""
    if (folder, name, kind) in _reported:
        return
    _reported.add((folder, name, kind))
    log.warning("membackend: %s/%s %s; the APU budget leaves the sysfs figure out, as when the files are missing",
                folder, name, why)


def system_reserve(ram_total: int) -> int:
    """Bytes of the host's ``MemAvailable`` kept for the system on an APU: a 32nd of its RAM within
    1-4 GiB (4 GiB on a 128 GB Strix Halo), since the desktop and the kernel run from the same pool."""
    return min(max(ram_total // 32, 1 * GiB), 4 * GiB)


@dataclass(frozen=True)
class ApuFigure:
    """One of the three figures: what it says is free (``free``) of ``total``, and how it was read."""

    name: str
    total: int
    free: int
    how: str


@dataclass(frozen=True)
class ApuPool:
    """The budget of an APU's pool: the smallest of its figures, which one bound, and all of them."""

    total: int
    free: int
    bound: str
    figures: tuple[ApuFigure, ...]
    note: str = ""  # a figure that could not be read

    @property
    def label(self) -> str:
        """The source line: ``APU pool, bound by <figure>: <each figure with how it was read>``."""
        shown = "; ".join([f"{f.name} {_gib(f.free)} ({f.how})" for f in self.figures] + [self.note] * bool(self.note))
        return f"APU pool, bound by {self.bound}: {shown}"


def _sane(sysfs: AmdgpuMemory | None, machine: int) -> AmdgpuMemory | None:
    """``sysfs`` when its totals are above zero and at most the ``machine``'s memory (bytes) and its use at most
    its totals; else None, logged once."""
    if sysfs is None:
        return None
    for part in ("vram", "gtt"):
        total, used = getattr(sysfs, f"{part}_total"), getattr(sysfs, f"{part}_used")
        if not 0 < total <= machine or not 0 <= used <= total:
            report_bad_file(sysfs.path, f"mem_info_{part}_*", "out of range", f"say {used} of {total} bytes in use; "
                            f"accepted: a total above zero and at most the machine's memory ({machine} bytes: "
                            f"{MACHINE_PER_COUNT} x MemTotal or the driver's total), a use at most the total")
            return None
    return sysfs


def _gib(n: int) -> str:
    return format_size(n)  # as membackend writes every size


def apu_pool(hip_free: int, hip_total: int, call: str, sysfs: AmdgpuMemory | None, ram_total: int,
             ram_available: int) -> ApuPool:
    """The smallest of the three figures (see the module docstring).

    ``hip_free``/``hip_total``: the runtime's mem-get-info (``call`` names it);
    ``sysfs``: the device's amdgpu files (None: not readable, that figure is
    left out and the line says so; one whose total is not above zero or is
    above the machine's memory, :data:`MACHINE_PER_COUNT` times the larger of
    ``ram_total`` and ``hip_total``, or whose use is above its total, is left
    out too, logged once); ``ram_total``/``ram_available``: the host's
    ``MemTotal``/``MemAvailable``. The pool's total is the smallest of the
    totals, so a free never exceeds it.
    """
    sysfs = _sane(sysfs, MACHINE_PER_COUNT * max(ram_total, hip_total))
    trusted, how = hip_free, f"{call} free of {_gib(hip_total)}"
    if hip_free > hip_total:  # not a free at all: at most the total, less what sysfs says is in use
        in_use = sysfs.vram_used + sysfs.gtt_used if sysfs is not None else 0
        trusted = max(0, hip_total - in_use)
        how = (f"{call} free, reported {_gib(hip_free)} above its own total {_gib(hip_total)}: taken as the "
               f"total less {_gib(in_use)} in use")
    # a HIP that answers the carve-out alone describes the carve-out, not the pool: shown, not counted
    carve_only = sysfs is not None and sysfs.gtt_total > 0 and hip_total <= sysfs.vram_total
    if carve_only:
        how = f"{call} total {_gib(hip_total)} is the carve-out alone, not the pool: not counted"
    figures = [ApuFigure(call, hip_total, trusted, how)]
    if sysfs is not None:
        figures.append(ApuFigure("sysfs", sysfs.total, sysfs.left,
                                 f"carve-out {_gib(sysfs.vram_total)} + GTT {_gib(sysfs.gtt_total)} less "
                                 f"{_gib(sysfs.vram_used + sysfs.gtt_used)} used, {sysfs.path}"))
    reserve = system_reserve(ram_total)
    figures.append(ApuFigure("MemAvailable", max(0, ram_total - reserve), max(0, ram_available - reserve),
                             f"{_gib(ram_available)} less {_gib(reserve)} kept for the system"))
    counted = figures[1:] if carve_only else figures
    bound = min(counted, key=lambda f: f.free)
    total = min(f.total for f in counted)
    note = "" if sysfs is not None else "sysfs amdgpu memory files not readable"
    return ApuPool(total=total, free=min(bound.free, total), bound=bound.name, figures=tuple(figures), note=note)
