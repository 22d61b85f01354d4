"""Thin wrapper over the OS virtual-memory calls the host backend needs.

One shape on every OS: ``reserve`` (address space, no memory), ``commit``
(make a range usable), ``populate`` (make it resident now), ``decommit``
(drop the memory, keep the addresses) and ``release`` (give the addresses
back). Failures raise :class:`~membackend.types.DriverError` with the errno
or Windows error code and the name of the call.

POSIX uses ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``,
``mprotect``, ``madvise`` and ``munmap`` (man 2 mmap, mprotect, madvise);
Windows uses ``VirtualAlloc``/``VirtualFree`` with ``MEM_RESERVE``,
``MEM_COMMIT``, ``MEM_DECOMMIT``, ``MEM_RELEASE`` (Win32 memoryapi.h docs).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..types import DriverError

__all__ = ["HostDriver", "PosixHostDriver", "WindowsHostDriver", "host_driver", "os_page_size", "win32_args",
           "resident_bytes", "is_mapped"]

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE = 0x02
if sys.platform == "darwin":
    MAP_ANONYMOUS, MAP_NORESERVE = 0x1000, 0x40
else:  # Linux values (asm-generic/mman-common.h, x86/arm64 mman.h)
    MAP_ANONYMOUS, MAP_NORESERVE = 0x20, 0x4000
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14  # Linux >= 2.6.38
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; EINVAL on older kernels
MAP_FAILED = ctypes.c_void_p(-1).value
HUGE = 2 << 20
PARALLEL_MIN = 8 << 20  # below this a thread hand-off costs more than it saves
MAX_POPULATE_WORKERS = 4

# Win32 constants (winnt.h)
MEM_COMMIT, MEM_RESERVE, MEM_DECOMMIT, MEM_RELEASE = 0x1000, 0x2000, 0x4000, 0x8000
PAGE_NOACCESS, PAGE_READWRITE = 0x01, 0x04


def os_page_size() -> int:
    return mmap.PAGESIZE


def _touch(addr: int, size: int, step: int) -> None:
    """Write one byte per OS page so the kernel backs each page now."""
    buf = (ctypes.c_char * size).from_address(addr)
    for off in range(0, size, step):
        buf[off] = b"\0"


class HostDriver:
    """The five calls; ``populate_method`` says how ``populate`` makes pages resident."""

    populate_method = "touch"

    def reserve(self, size: int, align: int) -> int: ...
    def commit(self, addr: int, size: int) -> None: ...
    def populate(self, addr: int, size: int) -> None: ...
    def decommit(self, addr: int, size: int) -> None: ...
    def release(self, addr: int, size: int) -> None: ...


class PosixHostDriver(HostDriver):
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._munmap = libc.munmap
        self._mprotect = libc.mprotect
        self._madvise = libc.madvise
        for fn in (self._munmap, self._mprotect, self._madvise):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.page = os_page_size()
        self.populate_method = "madvise(MADV_POPULATE_WRITE)" if sys.platform.startswith("linux") else "touch"
        self.hugepages = self._thp_enabled()
        self.workers = min(os.cpu_count() or 1, MAX_POPULATE_WORKERS)
        self._executor: ThreadPoolExecutor | None = None

    @staticmethod
    def _thp_enabled() -> bool:
        try:
            mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        except OSError:
            return False
        return "[always]" in mode or "[madvise]" in mode

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise DriverError(err, call, os.strerror(err))

    def reserve(self, size: int, align: int) -> int:
        """Reserve ``size`` bytes aligned to ``align`` (over-reserve, then trim both ends)."""
        align = max(align, self.page)
        span = size + (align if align > self.page else 0)
        addr = self._mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise DriverError(err, "mmap", os.strerror(err))
        start = (addr + align - 1) // align * align
        if start > addr:
            self._check(self._munmap(addr, start - addr), "munmap")
        tail = addr + span - (start + size)
        if tail > 0:
            self._check(self._munmap(start + size, tail), "munmap")
        if self.hugepages and align >= HUGE:
            # THP in "madvise" mode backs 2 MiB-aligned ranges with huge pages only when asked
            self._madvise(start, size, MADV_HUGEPAGE)
        return start

    def commit(self, addr: int, size: int) -> None:
        self._check(self._mprotect(addr, size, PROT_READ | PROT_WRITE), "mprotect")

    def populate(self, addr: int, size: int) -> None:
        """Make ``[addr, addr+size)`` resident; big ranges are split across threads.

        The kernel zeroes every new page, one core at a time per call; splitting
        a range over the cores (ctypes drops the GIL during the call) is what
        brings population near memset bandwidth.
        """
        if size >= PARALLEL_MIN and self.workers > 1:
            per_worker = -(-size // self.workers)
            step = -(-per_worker // HUGE) * HUGE  # keep chunks on huge-page boundaries
            chunks = [(a, min(step, addr + size - a)) for a in range(addr, addr + size, step)]
            errors = [e for e in self._pool().map(self._populate_chunk, chunks) if e is not None]
            if errors:
                raise errors[0]
            return
        error = self._populate_chunk((addr, size))
        if error is not None:
            raise error

    def _populate_chunk(self, chunk: tuple[int, int]) -> DriverError | None:
        addr, size = chunk
        if self.populate_method.startswith("madvise"):
            if self._madvise(addr, size, MADV_POPULATE_WRITE) == 0:
                return None
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # ENOMEM, EFAULT, EHWPOISON: a real failure
                return DriverError(err, "madvise(MADV_POPULATE_WRITE)", os.strerror(err))
            self.populate_method = "touch"  # kernel older than 5.14
        _touch(addr, size, self.page)
        return None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="membackend-populate")
        return self._executor

    def decommit(self, addr: int, size: int) -> None:
        self._check(self._madvise(addr, size, MADV_DONTNEED), "madvise(MADV_DONTNEED)")
        self._check(self._mprotect(addr, size, PROT_NONE), "mprotect")

    def release(self, addr: int, size: int) -> None:
        self._check(self._munmap(addr, size), "munmap")


def win32_args(call: str, addr: int | None, size: int) -> tuple[str, tuple]:
    """The Win32 function and its arguments for one of the five calls (unit-tested anywhere)."""
    if call == "reserve":
        return "VirtualAlloc", (None, size, MEM_RESERVE, PAGE_NOACCESS)
    if call == "commit":
        return "VirtualAlloc", (addr, size, MEM_COMMIT, PAGE_READWRITE)
    if call == "decommit":
        return "VirtualFree", (addr, size, MEM_DECOMMIT)
    if call == "release":  # MEM_RELEASE requires size 0 and the reservation's base
        return "VirtualFree", (addr, 0, MEM_RELEASE)
    raise ValueError(f"unknown call {call!r}; accepted: reserve, commit, decommit, release")


class WindowsHostDriver(HostDriver):
    def __init__(self, kernel32: object | None = None) -> None:
        if kernel32 is None:
            kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
            kernel32.VirtualAlloc.restype = ctypes.c_void_p
            kernel32.VirtualAlloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint32]
            kernel32.VirtualFree.restype = ctypes.c_int
            kernel32.VirtualFree.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32]
        self._k = kernel32
        self._last_error: Callable[[], int] = getattr(ctypes, "get_last_error", lambda: 0)
        self.page = os_page_size()

    def _call(self, call: str, addr: int | None, size: int) -> int:
        fn, args = win32_args(call, addr, size)
        result = getattr(self._k, fn)(*args)
        if not result:
            raise DriverError(self._last_error(), fn, f"{call} of {size} bytes")
        return result

    def reserve(self, size: int, align: int) -> int:
        return self._call("reserve", None, size)  # 64 KiB aligned by the OS

    def commit(self, addr: int, size: int) -> None:
        self._call("commit", addr, size)

    def populate(self, addr: int, size: int) -> None:
        _touch(addr, size, self.page)

    def decommit(self, addr: int, size: int) -> None:
        self._call("decommit", addr, size)

    def release(self, addr: int, size: int) -> None:
        self._call("release", addr, size)


def resident_bytes(addr: int, size: int) -> int:
    """Bytes of ``[addr, addr+size)`` the kernel holds in RAM now (mincore(2); Linux and macOS)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os_page_size()
    vec = (ctypes.c_ubyte * (-(-size // page)))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    if libc.mincore(addr, size, vec) != 0:
        err = ctypes.get_errno()
        raise DriverError(err, "mincore", os.strerror(err))
    return sum(b & 1 for b in vec) * page


def is_mapped(addr: int, maps: str = "/proc/self/maps") -> bool:
    """Whether ``addr`` lies in any mapping of this process (Linux)."""
    with open(maps) as f:
        for line in f:
            lo, _, hi = line.partition(" ")[0].partition("-")
            if int(lo, 16) <= addr < int(hi, 16):
                return True
    return False


def host_driver() -> HostDriver:
    return WindowsHostDriver() if sys.platform == "win32" else PosixHostDriver()
