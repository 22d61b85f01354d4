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
import logging
import os
import random
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .._hostmem import os_page_size
from ..types import DriverError

log = logging.getLogger(__name__)

__all__ = ["HostDriver", "PosixHostDriver", "WindowsHostDriver", "FailingHostDriver", "host_driver", "os_page_size",
           "win32_args", "resident_bytes", "is_mapped"]

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE = 0x02
if sys.platform == "darwin":
    MAP_ANONYMOUS, MAP_NORESERVE = 0x1000, 0x40
else:  # Linux values (asm-generic/mman-common.h, x86/arm64 mman.h)
    MAP_ANONYMOUS, MAP_NORESERVE = 0x20, 0x4000
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14  # Linux >= 2.6.38
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; EINVAL on older kernels (and, on any kernel, for an inaccessible range)
MAP_FAILED = ctypes.c_void_p(-1).value
HUGE = 2 << 20
PARALLEL_MIN = 8 << 20  # below this a thread hand-off costs more than it saves
MAX_POPULATE_WORKERS = 4

# Win32 constants (winnt.h)
MEM_COMMIT, MEM_RESERVE, MEM_DECOMMIT, MEM_RELEASE = 0x1000, 0x2000, 0x4000, 0x8000
PAGE_NOACCESS, PAGE_READWRITE = 0x01, 0x04


def _touch(addr: int, size: int, step: int) -> None:
    """Write one byte per OS page so the kernel backs each page now."""
    buf = (ctypes.c_char * size).from_address(addr)
    for off in range(0, size, step):
        buf[off] = b"\0"


class HostDriver:
    """The five calls; ``populate_method`` says how ``populate`` makes pages resident.

    ``shutdown_pool()`` stops any helper threads the driver started; they
    come back on the next call that needs them.
    """

    populate_method = "touch"

    def reserve(self, size: int, align: int) -> int: raise NotImplementedError
    def commit(self, addr: int, size: int) -> None: ...
    def populate(self, addr: int, size: int) -> None: ...
    def decommit(self, addr: int, size: int) -> None: ...
    def release(self, addr: int, size: int) -> None: ...

    def shutdown_pool(self) -> None:
        """Stop helper threads (none here)."""


class PosixHostDriver(HostDriver):
    """mmap/mprotect/madvise/munmap through libc (Linux, macOS).

    ``madvise`` replaces libc's madvise (same signature and errno convention);
    tests use it to play a kernel without ``MADV_POPULATE_WRITE``.
    """

    def __init__(self, madvise: Callable[[int, int, int], int] | None = None) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._munmap = libc.munmap
        self._mprotect = libc.mprotect
        libc_madvise = libc.madvise
        for fn in (self._munmap, self._mprotect, libc_madvise):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._madvise: Callable[[int, int, int], int] = madvise if madvise is not None else libc_madvise
        self.page = os_page_size()
        self.populate_method = self._probe_populate_method()
        self.hugepages = self._thp_enabled()
        self.workers = min(os.cpu_count() or 1, MAX_POPULATE_WORKERS)
        self._executor: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _probe_populate_method(self) -> str:
        """Decide once, at start-up, whether ``MADV_POPULATE_WRITE`` works here.

        The probe populates one page of a private read-write scratch mapping:
        the only way that fails with EINVAL is a kernel older than 5.14 (man 2
        madvise). Deciding later, from an EINVAL on a live range, cannot tell
        an old kernel from a range that is not accessible (freed or released
        under the call), and touching such a range is a SIGSEGV.
        """
        if not sys.platform.startswith("linux"):
            return "touch"
        scratch = self._mmap(None, self.page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if scratch in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise DriverError(err, "mmap", f"scratch page for the populate probe: {os.strerror(err)}")
        try:
            if self._madvise(scratch, self.page, MADV_POPULATE_WRITE) == 0:
                return "madvise(MADV_POPULATE_WRITE)"
            err = ctypes.get_errno()
            # EINVAL: advice unknown (kernel < 5.14); anything else (a sandbox's EPERM/ENOSYS) also
            # means the call is unusable. Touching is correct on any kernel, only slower.
            log.debug("MADV_POPULATE_WRITE unusable (%s): populating by touching pages", os.strerror(err))
            return "touch"
        finally:
            self._check(self._munmap(scratch, self.page), "munmap")

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
        brings population near memset bandwidth. Every failure is a
        ``DriverError``; with ``MADV_POPULATE_WRITE`` an EINVAL means the range
        is not accessible, never "try touching instead".
        """
        if size >= PARALLEL_MIN and self.workers > 1:
            per_worker = -(-size // self.workers)
            step = -(-per_worker // HUGE) * HUGE  # keep chunks on huge-page boundaries
            chunks = [(a, min(step, addr + size - a)) for a in range(addr, addr + size, step)]
            errors = [e for e in (f.result() for f in self._submit(chunks)) if e is not None]
            if errors:
                raise errors[0]
            return
        error = self._populate_chunk((addr, size))
        if error is not None:
            raise error

    def _populate_chunk(self, chunk: tuple[int, int]) -> DriverError | None:
        addr, size = chunk
        if self.populate_method == "touch":
            _touch(addr, size, self.page)
            return None
        if self._madvise(addr, size, MADV_POPULATE_WRITE) == 0:
            return None
        err = ctypes.get_errno()
        detail = os.strerror(err)
        if err == errno.EINVAL:
            detail += " (the range is not accessible: freed or released while being populated?)"
        return DriverError(err, "madvise(MADV_POPULATE_WRITE)", detail)

    def _submit(self, chunks: list[tuple[int, int]]) -> list[Future]:
        # submitting under the lock: a concurrent shutdown_pool() detaches the pool only between
        # two populates' submissions, and shutdown lets already submitted chunks finish
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="membackend-populate")
            return [self._executor.submit(self._populate_chunk, c) for c in chunks]

    def shutdown_pool(self) -> None:
        """Stop the populate threads after the chunks already submitted; the next big populate starts new ones."""
        with self._pool_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

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
    def __init__(self, kernel32: Any = None) -> None:
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


class FailingHostDriver(HostDriver):
    """Wraps a host driver so ``commit`` and ``populate`` fail at random, as the OS can under memory pressure.

    What fails, and with which code, follows the platform:

    - POSIX ``commit`` is ``mprotect``: ENOMEM when the kernel cannot allocate
      its structures or the map count limit is reached (man 2 mprotect).
    - POSIX ``populate`` with ``MADV_POPULATE_WRITE``: ENOMEM when memory
      cannot be allocated (man 2 madvise). Populating by touching pages cannot
      report a failure (the kernel kills the process instead), so it never fails here.
    - Windows ``commit`` is ``VirtualAlloc(MEM_COMMIT)``: ERROR_COMMITMENT_LIMIT
      (1455) when the page file is full (Win32 system error codes); Windows
      populates by touching, which does not fail.

    ``decommit`` and ``release`` are not failed: they give memory back and
    need none, and on our private anonymous mappings the kernel fails them
    only on programming errors (EINVAL for a bad range), not under memory
    pressure, which is what this models. Injected calls do nothing before
    raising, like the real calls. Thread-safe: one lock guards the seeded
    ``random.Random`` and the count, so a seed gives one sequence of draws.
    """

    def __init__(self, real: HostDriver, probability: float, seed: int):
        self.real = real
        self.probability = probability
        self.injected = 0
        self.active = True  # False once stopped: every call goes straight to ``real``
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        windows = isinstance(real, WindowsHostDriver)
        self._commit_failure = (1455, "VirtualAlloc") if windows else (errno.ENOMEM, "mprotect")
        self._populate_fails = not windows and real.populate_method.startswith("madvise")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    @property
    def populate_method(self) -> str:  # type: ignore[override]
        return self.real.populate_method

    def _draw(self) -> bool:
        if not self.active:
            return False
        with self._lock:
            if self._rng.random() < self.probability:
                self.injected += 1
                return True
            return False

    def reserve(self, size: int, align: int) -> int:
        return self.real.reserve(size, align)

    def commit(self, addr: int, size: int) -> None:
        if self._draw():
            code, call = self._commit_failure
            raise DriverError(code, call, f"injected: commit of {size} bytes")
        self.real.commit(addr, size)

    def populate(self, addr: int, size: int) -> None:
        if self._populate_fails and self._draw():
            raise DriverError(errno.ENOMEM, "madvise(MADV_POPULATE_WRITE)", f"injected: populate of {size} bytes")
        self.real.populate(addr, size)

    def decommit(self, addr: int, size: int) -> None:
        self.real.decommit(addr, size)

    def release(self, addr: int, size: int) -> None:
        self.real.release(addr, size)

    def shutdown_pool(self) -> None:
        self.real.shutdown_pool()


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
