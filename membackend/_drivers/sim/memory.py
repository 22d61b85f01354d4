"""The bytes of a simulated GPU: its address space and physical memory as real memory of this process.

A simulated device holds what a real one holds. :class:`SimMemory` backs the
simulated virtual-memory calls with the operating system's own, one call for
one call, following the CUDA driver API reference, "Virtual Memory Management"
(HIP mirrors it in ``hip_runtime_api.h``):

* ``cuMemAddressReserve`` -- address space without access: a
  ``mmap(PROT_NONE, MAP_SHARED | MAP_NORESERVE)`` of the size, aligned (man 2
  mmap), over a range of the ``memfd`` that no handle uses and no page is ever
  written to; no memory, no commit charge. Each reservation has its own such
  range, a page apart from every other, so the kernel never merges its mapping
  with a neighbour's (a mapping merges only with one of the same file at the
  next offset): freeing it never has to split a mapping;
* ``cuMemCreate`` -- physical memory of its own: a range of one ``memfd``
  (man 2 memfd_create) per simulated process, never shared with another
  handle and a page apart from the next one's (so two handles mapped side by
  side stay two mappings); its pages exist once written (tmpfs is sparse), as
  a GPU's do once its driver backs them;
* ``cuMemMap`` -- the handle's bytes appear at the address:
  ``mmap(MAP_SHARED | MAP_FIXED)`` of the handle's range of the file over the
  reserved addresses, still without access (``PROT_NONE``);
* ``cuMemSetAccess`` -- read and write access to the mapped range:
  ``mprotect(PROT_READ | PROT_WRITE)``;
* ``cuMemUnmap`` -- the bytes leave the address, which stays reserved: the
  reservation's own range of the file put back over it (``MAP_FIXED``), which
  merges with the reservation around it. The driver documents no
  out-of-resource failure of an unmap (CUDA driver API, ``cuMemUnmap``: "the
  address range is converted to an address reservation"; HIP's
  ``hipMemUnmap`` returns success, invalid value or not supported), but the
  kernel refuses every new mapping once a process holds ``vm.max_map_count``
  of them (``ENOMEM``, man 2 mmap). There the handle's mapping is left in
  place without access (``mprotect(PROT_NONE)``, which needs no new mapping)
  until the address range goes back, so a release never needs more mappings
  than it frees;
* ``cuMemRelease`` of a handle no address maps -- the memory is freed:
  ``fallocate(FALLOC_FL_PUNCH_HOLE)`` over its range of the file (man 2 fallocate);
* ``cuMemAddressFree`` -- the address range goes back: ``munmap`` of exactly
  the mappings it holds (none reaches past its ends), which never fails.

One handle mapped at two addresses shows the same bytes at both (both map the
same range of the file), as two mappings of one physical allocation do on a
GPU. A read or write through an address without access is the CPU's fault
(``SIGSEGV``), never served silently; the simulated driver's own copies check
the mappings first and report ``..._ERROR_ILLEGAL_ADDRESS`` instead
(:class:`~membackend._drivers.sim.platform.SimPlatform`).

The ``memfd`` is this object's only file descriptor. It is closed as soon as
nothing holds a range of it (:meth:`SimMemory.drop_file`, when the driver
closes after a session released everything), not when the object is
collected, and opened anew on the next reservation or allocation. A process
with no descriptor left gets a typed error naming its open-file limit.

Where the operating system cannot do this (no ``memfd_create``: not Linux),
:func:`open_memory` answers a :class:`BooksOnly` that says why, and the
simulation keeps books only, as before.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import sys
import threading
from typing import Any

from ..._settings.rules import FILES_ACCEPTED, out_of_files
from ...types import DriverError

__all__ = ["SimMemory", "BooksOnly", "open_memory", "MemoryCallFailed"]

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
# Linux values (asm-generic/mman-common.h, x86/arm64 mman.h; linux/falloc.h)
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MAP_FAILED = ctypes.c_void_p(-1).value
#: where the reservations' ranges of the file start: far above any handle's (the handles' end is the file's
#: size, a device's memory at most), so no reservation's range ever sits next to a handle's
ADDRESS_RANGES = 1 << 48


class MemoryCallFailed(OSError):
    """An operating-system call behind the simulation failed (``errno`` set); the simulated driver
    answers it as the real call's out-of-memory or invalid-value code."""


class BooksOnly:
    """No bytes: the simulation keeps its tables only; ``reason`` says why (doctor and tests show it)."""

    backed = False

    def __init__(self, reason: str):
        self.reason = reason

    def close(self) -> None:
        pass


class SimMemory:
    """One simulated process's device memory; every method is one operating-system call or two.

    Not locked: the :class:`~membackend._drivers.sim.platform.SimPlatform` calls it under its own lock.
    """

    backed = True
    reason = "memory of this process (memfd_create, mmap): the bytes a GPU would hold"

    def __init__(self, label: str):
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        self._munmap = libc.munmap
        self._munmap.restype = ctypes.c_int
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._mprotect = libc.mprotect
        self._mprotect.restype = ctypes.c_int
        self._mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._fallocate = libc.fallocate
        self._fallocate.restype = ctypes.c_int
        self._fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._label = label
        self.fd = -1
        self.fd = self._file()
        self._end = 0  # the file's size: every handle gets a fresh range (never reused; freed by a hole)
        self._next_range = ADDRESS_RANGES  # the next reservation's range of the file (no page is ever written)
        #: base -> (size, offset of the file mapped at base) of every live reservation
        self._reserved: dict[int, tuple[int, int]] = {}
        self._bases: list[int] = []  # the live reservations' bases, sorted (unmap finds its reservation)
        self._host: dict[int, int] = {}  # address -> size of every host allocation
        self._lock = threading.Lock()  # close() may run from a finalizer on any thread

    @staticmethod
    def _fail(call: str) -> MemoryCallFailed:
        code = ctypes.get_errno()
        return MemoryCallFailed(code, f"{call}: {os.strerror(code)}")

    def _file(self) -> int:
        """The memory file's descriptor, opened when there is none (first use, or after :meth:`drop_file`);
        ``MemoryCallFailed`` when it cannot be (no descriptor left: the words name the limit)."""
        if self.fd < 0:
            try:
                self.fd = os.memfd_create(f"membackend-sim-{self._label}", os.MFD_CLOEXEC)
            except OSError as exc:
                held = out_of_files(exc)
                raise MemoryCallFailed(exc.errno or errno.EMFILE, f"memfd_create: {held}; accepted: {FILES_ACCEPTED}"
                                       if held else f"memfd_create: {exc.strerror or exc}") from None
        return self.fd

    def drop_file(self) -> bool:
        """Close the memory file now if no reservation maps it (the caller vouches that no handle holds a range
        of it); the next reservation or allocation opens a new one. Whether it was closed."""
        with self._lock:
            if self._reserved or self.fd < 0:
                return False
            fd, self.fd = self.fd, -1
            self._end, self._next_range = 0, ADDRESS_RANGES
        os.close(fd)
        return True

    def _map(self, addr: int | None, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
        got = self._mmap(addr, size, prot, flags, fd, offset)
        if got in (None, MAP_FAILED):
            raise self._fail("mmap")
        return int(got)

    # -- address space

    def reserve(self, size: int, alignment: int) -> int:
        """``size`` bytes of address space at a multiple of ``alignment``, no access, no memory: its own range
        of the file (see the module docstring). ``MemoryCallFailed`` with nothing left mapped if it cannot."""
        span = size + alignment
        offset = self._next_range
        raw = self._map(None, span, PROT_NONE, MAP_SHARED | MAP_NORESERVE, self._file(), offset)
        self._next_range += span + self._page  # a page apart: never the next offset of another reservation's
        base = -(-raw // alignment) * alignment
        tail = raw + span - (base + size)
        # trimming splits the fresh mapping, which the kernel may refuse at its mapping limit: then none of it stays
        if (base > raw and self._munmap(raw, base - raw) != 0) or (tail and self._munmap(base + size, tail) != 0):
            failed = self._fail("munmap")
            self._munmap(raw, span)  # whole mappings only: this never needs a split
            raise failed
        with self._lock:
            self._reserved[base] = (size, offset + (base - raw))
            bisect.insort(self._bases, base)
        return base

    def unreserve(self, base: int, size: int) -> None:
        """The range goes back to the operating system."""
        with self._lock:
            if self._reserved.pop(base, None) is not None:
                del self._bases[bisect.bisect_left(self._bases, base)]
        if self._munmap(base, size) != 0:
            raise self._fail("munmap")

    # -- physical memory

    def create(self, size: int) -> int:
        """A fresh range of the file for a handle; returns its offset. No page exists until written."""
        fd, offset = self._file(), self._end
        try:
            os.ftruncate(fd, offset + size)
        except OSError as exc:
            raise MemoryCallFailed(exc.errno or errno.ENOMEM, f"ftruncate: {exc.strerror}") from None
        self._end = offset + size + self._page  # a page apart: two handles side by side never merge into one mapping
        return offset

    def free(self, offset: int, size: int) -> None:
        """The handle's memory goes back (its range of the file becomes a hole)."""
        if self._fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, size) != 0:
            raise self._fail("fallocate")

    # -- mappings

    def map(self, va: int, size: int, offset: int) -> None:
        """The handle's bytes at ``va``, no access yet."""
        self._map(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, self.fd, offset)

    def set_access(self, va: int, size: int) -> None:
        if self._mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            raise self._fail("mprotect")

    def unmap(self, va: int, size: int) -> None:
        """The bytes leave ``va``; the addresses stay reserved, without access. Needs no new mapping: at the
        kernel's mapping limit the handle's mapping stays, without access, until the range goes back."""
        with self._lock:
            at = bisect.bisect_right(self._bases, va) - 1
            base = self._bases[at] if at >= 0 else -1
            reserved, offset = self._reserved.get(base, (0, 0))
        if not base <= va < va + size <= base + reserved:
            raise MemoryCallFailed(errno.EINVAL, f"unmap: [{va:#x}, {va + size:#x}) is in no reservation")
        got = self._mmap(va, size, PROT_NONE, MAP_SHARED | MAP_NORESERVE | MAP_FIXED, self.fd, offset + (va - base))
        if got not in (None, MAP_FAILED):
            return
        code = ctypes.get_errno()
        if code != errno.ENOMEM:
            raise MemoryCallFailed(code, f"mmap: {os.strerror(code)}")
        # vm.max_map_count reached: mmap refuses any new mapping. The handle's mapping is exactly its own (handles
        # never merge), so taking its access away splits nothing; munmap of the reservation removes it later
        if self._mprotect(va, size, PROT_NONE) != 0:
            raise self._fail("mprotect")

    # -- host memory (cuMemAllocHost)

    def host_alloc(self, size: int) -> int:
        """Host memory of ``size`` bytes, read-write, its pages made once touched."""
        address = self._map(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
        with self._lock:
            self._host[address] = size
        return address

    def host_free(self, address: int) -> int:
        """Give back what :meth:`host_alloc` returned; its size (``KeyError`` for anything else)."""
        with self._lock:
            size = self._host.pop(address)
        self._munmap(address, size)
        return size

    # -- bytes

    @staticmethod
    def copy(dst: int, src: int, size: int) -> None:
        """``size`` bytes from ``src`` to ``dst`` (both accessible: the caller checked)."""
        ctypes.memmove(dst, src, size)

    @staticmethod
    def read(va: int, size: int) -> bytes:
        return ctypes.string_at(va, size)

    def close(self) -> None:
        """Every reservation's addresses and the file go back (the simulated process ended)."""
        with self._lock:
            reserved, self._reserved, self._bases = self._reserved, {}, []
            host, self._host = self._host, {}
            fd, self.fd = self.fd, -1
        for base, size in (*((b, r[0]) for b, r in reserved.items()), *host.items()):
            self._munmap(base, size)
        if fd >= 0:
            os.close(fd)


def open_memory(label: str, hold_bytes: bool = True) -> Any:
    """:class:`SimMemory` where the operating system can back a simulated GPU; else :class:`BooksOnly`
    saying why (``hold_bytes=False``: asked for books only, as a replay of a machine larger than this one)."""
    if not hold_bytes:
        return BooksOnly("books only, as asked (a replay models sizes and times, not bytes)")
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return BooksOnly(f"books only: {sys.platform} has no memfd_create to back a simulated GPU's memory")
    try:
        return SimMemory(label)
    except (OSError, AttributeError) as exc:
        if isinstance(exc, OSError) and (why := out_of_files(exc)) is not None:  # not a reason to hold no bytes
            raise DriverError(errno.errorcode.get(exc.errno or 0, exc.errno), "memfd_create",
                              f"{why}; accepted: {FILES_ACCEPTED}") from None
        return BooksOnly(f"books only: the simulated GPU's memory could not be set up ({exc})")
