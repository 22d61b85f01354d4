"""Drop-ins for comfy-aimdo's ``VRAMBuffer``, ``HostBuffer`` and ``ModelMMAP`` when another backend runs.

With a backend other than aimdo selected, comfy-aimdo never initialised a
device: its ``VRAMBuffer`` raises (no device context), its ``HostBuffer``
registers host memory with a driver that has no context (that crashes the
process), and its ``ModelMMAP`` needs aimdo's library state. ComfyUI calls them
from ``model_management.get_aimdo_cast_buffer``, ``pinned_memory`` and
``ModelPatcherDynamic.load``, and ``utils.load_safetensors``. The adapter
replaces the three classes (where they exist) with these, same constructor
parameters and methods:

* :class:`VRAMBuffer` -- the cast buffer: ``get(size, offset=0)`` answers
  ``(self, address, size)`` over device memory torch allocates (one block per
  offset, kept until the buffer is dropped, which ComfyUI does after every
  node); ``aimdo_to_tensor`` of such a tuple is a view of that block. A range
  past ``max_size`` raises ``RuntimeError`` as aimdo's grow failure does.
* :class:`HostBuffer` -- growable host memory at a fixed address (an anonymous
  mapping of ``max(size, max_grow_size)`` bytes). ``register``/``unregister``
  do nothing: page-locking needs aimdo's device; copies from it are then
  ordinary, synchronous host copies. ``read_file_slice`` reads the file into
  the buffer and, with a ``device_ptr``, copies the bytes to the device.
  ``truncate`` gives the whole pages past the cut back to the system, as
  aimdo's decommits them.
* :class:`ModelMMAP` -- a private, copy-on-write memory map of the file
  (Python's ``mmap``); ``get()`` its address, ``bounce()`` drops its pages.
* :func:`read_file_to_device` -- comfy-aimdo's staged file reader (``comfy.memory_management``
  loads a weight's bytes from its file straight to device memory with it): here a
  plain read into host memory, then a copy to the device range. :func:`cleanup_file_reader`
  has no staging ring to give back.

A read bound for the device whose bytes VRAM holds already (a model ComfyUI dropped and loads again from the
same file) is copied on the device instead (:mod:`.reuse`): nothing is read from the file.

Exceptions are aimdo's (``RuntimeError`` with aimdo's messages), so ComfyUI's
own handling of them applies unchanged.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

from .runtime import current

log = logging.getLogger("membackend")

__all__ = ["VRAMBuffer", "HostBuffer", "ModelMMAP", "read_file_to_device", "cleanup_file_reader", "tensor_of"]


def _address(buf: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class VRAMBuffer:
    """comfy-aimdo's ``VRAMBuffer(max_size, device)`` over torch-allocated device memory."""

    #: the buffers alive in this process (:meth:`holding`)
    _live: "weakref.WeakSet[VRAMBuffer]" = weakref.WeakSet()

    def __init__(self, max_size, device):
        rt = current()
        if rt is None or rt.session is None:
            raise RuntimeError(f"device {device} is not initialized (membackend has not started)")
        self.device = device
        self.max_size = int(max_size)
        self._torch_device = rt.session.tensor_device(rt.device_for(device))
        self._blocks: dict[int, Any] = {}  # offset -> uint8 tensor
        self._allocated = 0
        self.base_addr = 0
        VRAMBuffer._live.add(self)

    @classmethod
    def holding(cls, ptr: int) -> bool:
        """Whether ``ptr`` is inside a block of a live cast buffer (device memory of ComfyUI's cast path)."""
        for buf in list(cls._live):
            for block in list(buf._blocks.values()):
                start = int(block.data_ptr())
                if start <= ptr < start + block.numel():
                    return True
        return False

    def size(self):
        return self._allocated

    def get(self, size, offset=0):
        offset, size = int(offset), int(size)
        if offset < 0 or size < 0 or offset + size > self.max_size:
            raise RuntimeError(f"VRAM grow failed: {offset + size} bytes")
        block = self._blocks.get(offset)
        if block is None or block.numel() < size:
            import torch

            block = self._blocks[offset] = torch.empty(max(size, 1), dtype=torch.uint8, device=self._torch_device)
        self._allocated = max(self._allocated, offset + size)
        return (self, int(block.data_ptr()), size)

    def tensor(self, ptr: int, size: int) -> Any:
        for block in self._blocks.values():
            start = int(block.data_ptr())
            if start <= ptr and ptr + size <= start + block.numel():
                return block[ptr - start:ptr - start + size]
        raise RuntimeError(f"address {ptr:#x} ({size} bytes) is not inside this cast buffer")


def tensor_of(alloc: Any) -> Any:
    """``aimdo_to_tensor`` for a :class:`VRAMBuffer` tuple."""
    buf, ptr, size = alloc
    return buf.tensor(int(ptr), int(size))


class HostBuffer:
    """comfy-aimdo's ``HostBuffer``: growable host memory at a fixed address, never page-locked by itself.

    ComfyUI page-locks each extension itself (``cudaHostRegister`` of the pin it cut at the extension's start,
    ``comfy/pinned_memory.py``) and leaves the unlocking to the buffer: ``truncate(size, do_unregister=True)``
    and the buffer's end, as aimdo's do (comfy-aimdo ``src/hostbuf.c``: truncate calls ``cuMemHostUnregister``,
    ``hostbuf_free`` releases the rest). So this buffer remembers where each extension starts and, on those
    two occasions, asks the session's driver to unregister what starts there before the memory goes. A
    registration must never outlive its mapping: the driver would keep copying a later mapping at those
    addresses from the old, locked pages (stale bytes), or refuse a copy that crosses its edge
    ("invalid argument"). Where no session can be asked (membackend stopped), the memory is kept instead.

    A truncate also gives the whole pages past the cut back to the system, as aimdo's decommits them
    (``hostbuf_truncate_impl``): ComfyUI destroys pins to relieve RAM (``partially_unload_ram``, the ``-fast``
    subsets first from 0.39 on) and counts their size as freed, so pages kept would leave the pressure as it was.
    Read again, they are zero. Not where a registration may outlive the cut (the memory stays as it is), and not
    on a platform without ``MADV_REMOVE`` (Windows, macOS: the pages stay until the buffer's end).
    """

    #: mappings whose registrations could not be ended (no session to ask): kept mapped for the process's life
    _kept: list[Any] = []

    def __init__(self, size, prewarm=0, max_grow_size=0, mark_cold=True):
        size, prewarm, max_grow_size = _ints("HostBuffer allocation", size, prewarm, max_grow_size)
        self.size = 0
        self.prewarm = max(0, prewarm)
        self._capacity = max(size, max_grow_size, 1)
        #: the byte offset of each extension, ascending: where ComfyUI may have registered a pin
        self._starts: list[int] = []
        self._keep_mapped = False  # set when a registration could not be ended: the memory then stays mapped
        self._touched = 0  # the end of what was ever extended or read into: pages up to it may be resident
        #: copies reading the buffer now (read_file_slice): close() waits for them, never unmaps under one
        self._copies = 0
        self._idle = threading.Condition()
        try:
            self._map: Any = mmap.mmap(-1, self._capacity)
        except (OSError, ValueError, OverflowError, MemoryError) as exc:
            raise RuntimeError(f"HostBuffer allocation failed ({exc})") from None
        self._base = _address(self._map)
        if size:
            self.extend(size)

    def get_raw_address(self):
        return self._base

    def extend(self, size, reallocate=False, register=True):
        size = int(size)
        if size < 0 or self.size + size > self._capacity:
            raise RuntimeError("HostBuffer.extend failed")
        start = self._base + self.size
        if size:
            self._starts.append(self.size)
        self.size += size
        self._touched = max(self._touched, self.size)
        return start if size else 0

    def read_file_slice(self, file_obj, file_offset, size, offset=0, stream=0, device_ptr=0, device=-1):
        size, offset, file_offset, device_ptr = _ints("HostBuffer.read_file_slice", size, offset, file_offset,
                                                      device_ptr or 0)
        if offset < 0 or size < 0 or file_offset < 0 or offset + size > self._capacity:
            raise RuntimeError("HostBuffer.read_file_slice failed")
        with self._copying("HostBuffer.read_file_slice") as mapped:
            if not (device_ptr and _from_vram(file_obj, file_offset, size, device_ptr, device, self._base + offset)):
                _read_into(file_obj, memoryview(mapped)[offset:offset + size], file_offset,
                           "HostBuffer.read_file_slice")
                if device_ptr:
                    _to_device(self._base + offset, size, device_ptr, device)
                    _read_to_device(file_obj, file_offset, size, device_ptr)
            self.size = max(self.size, offset + size)
            self._touched = max(self._touched, self.size)

    @contextlib.contextmanager
    def _copying(self, what: str) -> Iterator[Any]:
        """The mapping, kept mapped until the copy in the ``with`` block is done (``close`` waits for it);
        aimdo's ``RuntimeError`` when the buffer is closed."""
        with self._idle:
            mapped = self._map
            if mapped is None:
                raise RuntimeError(f"{what} failed (the HostBuffer is closed)")
            self._copies += 1
        try:
            yield mapped
        finally:
            with self._idle:
                self._copies -= 1
                self._idle.notify_all()

    def register(self, offset, size):
        """Page-locking is ComfyUI's own (``cudaHostRegister``): nothing to do."""

    def unregister(self, offset):
        """See :meth:`register`."""

    def truncate(self, size, do_unregister=True):
        size = int(size)
        if size < 0 or size > self._capacity:
            raise RuntimeError("HostBuffer.truncate failed")
        cut = bisect.bisect_left(self._starts, size)
        gone, self._starts = self._starts[cut:], self._starts[:cut]
        if do_unregister and gone and not _unregister(self._base + start for start in gone):
            self._keep_mapped = True  # a registration may outlive this buffer: never unmapped (see the class)
        self.size = size
        self._decommit(size)

    def _decommit(self, size: int) -> None:
        """The whole pages from ``size`` to the end of what was touched go back to the system (see the class)."""
        advice = getattr(mmap, "MADV_REMOVE", None)  # frees a shared anonymous mapping's pages, not only unmaps
        start = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        end = min(self._touched, self._capacity)
        mapped = self._map
        if advice is None or self._keep_mapped or mapped is None or end <= start:
            return
        try:
            mapped.madvise(advice, start, end - start)
        except (OSError, ValueError) as exc:  # closed under us, or refused: the pages stay until the end
            log.debug("membackend: giving back a HostBuffer's cut pages failed: %s", exc)
            return
        self._touched = start

    def close(self):
        """Ends what ComfyUI registered in this buffer, then unmaps it (aimdo's ``hostbuf_free``), once every copy
        reading it on another thread is done; a copy started after it is refused (``RuntimeError``)."""
        idle = getattr(self, "_idle", None)
        if idle is None:  # a constructor that failed: nothing was mapped
            return
        with idle:
            mapped, self._map = self._map, None
            while self._copies:
                idle.wait()
        starts, self._starts = self._starts, []
        if mapped is None:
            return
        if self._keep_mapped or (starts and not _unregister(self._base + start for start in starts)):
            HostBuffer._kept.append(mapped)
            return
        try:
            mapped.close()
        except BufferError:  # a pin tensor still views it: the map goes with the last reference
            pass

    def __del__(self):
        try:
            self.close()
        except Exception as exc:  # a finalizer must not raise
            log.debug("membackend: closing a collected HostBuffer failed: %s", exc)


def _unregister(addresses: Iterable[int]) -> bool:
    """Ask the session's driver to end a host registration at each of ``addresses`` (none there is fine);
    False when no session can be asked or the driver failed, so the caller keeps the memory mapped."""
    rt = current()
    if rt is None or rt.session is None:
        return False
    session = rt.session
    try:
        for address in addresses:
            session.host_unregister(address)
    except Exception as exc:  # noqa: BLE001 - kept mapped instead; told once
        rt.report_once("unregistering pinned host memory", exc, "the memory stays mapped")
        return False
    return True


#: a read at least this long is split into chunks of this size, read at once by the reader threads (comfy-aimdo
#: reads a file slice with a pool of 8 ``pread`` threads, ``src/hostbuf.c``: one thread is held to the speed of
#: one memory copy out of the page cache)
READ_CHUNK = 8 << 20
#: cores below which one thread reads (``benchmarks/bench_file_read.py`` on 2 shared cores: 0.91x)
READ_THREADS_FROM = 4
_readers: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()


def _ints(what: str, *values: Any) -> list[int]:
    """``values`` as ints (each at most 2**63 - 1 in size), or aimdo's ``RuntimeError`` naming ``what``."""
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError, OverflowError) as exc:
        raise RuntimeError(f"{what} failed ({exc})") from None
    if any(abs(v) >= 1 << 63 for v in out):
        raise RuntimeError(f"{what} failed (a size or offset beyond 2**63 - 1 bytes)")
    return out


def _forget_readers() -> None:
    """In a child of ``fork``: the parent's reader threads are not there, so the child makes its own pool."""
    global _readers, _readers_lock
    _readers, _readers_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_readers)


def _reader_pool() -> ThreadPoolExecutor:
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="membackend-read")
        return _readers


def _pread(fd: int, view: memoryview, file_offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], file_offset + got)
        if n <= 0:
            raise OSError(f"end of file at byte {file_offset + got}")
        got += n


def _read_into(file_obj: Any, view: memoryview, file_offset: int, what: str) -> None:
    """Fill ``view`` with the file's bytes from ``file_offset``, a long read in chunks on the reader threads;
    aimdo's ``RuntimeError`` when it cannot (the first chunk's error)."""
    try:
        fd = file_obj if isinstance(file_obj, int) else file_obj.fileno()
        if len(view) < 2 * READ_CHUNK or (os.cpu_count() or 1) < READ_THREADS_FROM:
            _pread(fd, view, file_offset)
            return
        chunks = [_reader_pool().submit(_pread, fd, view[o:o + READ_CHUNK], file_offset + o)
                  for o in range(0, len(view), READ_CHUNK)]
        errors = [exc for c in chunks if (exc := c.exception()) is not None]  # waits for every chunk
        if errors:
            raise errors[0]
    except (OSError, ValueError, AttributeError, OverflowError, TypeError) as exc:
        raise RuntimeError(f"{what} failed ({exc})") from None


def _to_device(host_address: int, size: int, device_ptr: int, device: Any) -> None:
    """Copy ``size`` bytes at ``host_address`` to ``device_ptr`` on ComfyUI's device index ``device``."""
    from .._tensors import tensor_at, torch_device

    rt = current()
    dev = rt.device_for(device) if rt is not None else "cpu:0"
    where = rt.session.tensor_device(dev) if rt is not None and rt.session is not None else None
    if (where or torch_device(dev)) == "cpu":  # the device's bytes are this process's memory: a plain copy
        ctypes.memmove(int(device_ptr), host_address, size)  # (torch's thread pool hangs in a child of fork)
        return
    tensor_at(int(device_ptr), size, dev, where=where).copy_(tensor_at(host_address, size, "cpu:0"))


def _from_vram(file_obj: Any, file_offset: int, size: int, device_ptr: int, device: Any, host: int = 0) -> bool:
    """Whether these bytes of the file were copied on the device (and to ``host``) from VRAM that holds them
    already (:class:`~.reuse.Reuse`): then nothing is read."""
    rt = current()
    return rt is not None and rt.reuse.read(file_obj, file_offset, size, int(device_ptr), device, host)


def _read_to_device(file_obj: Any, file_offset: int, size: int, device_ptr: int) -> None:
    """The file's bytes were just read into ``device_ptr``: counted, and known there (:class:`~.reuse.Reuse`)."""
    rt = current()
    if rt is not None:
        rt.reuse.wrote(file_obj, file_offset, size, int(device_ptr))


def read_file_to_device(file_obj, file_offset, size, stream, device_ptr, device, mark_cold=True):
    """comfy-aimdo's ``host_buffer.read_file_to_device``: ``size`` bytes of the file at ``file_offset`` into
    device memory at ``device_ptr``. Synchronous (``stream`` is accepted; the copy is done on return);
    ``mark_cold`` (aimdo's page-cache hint) has no meaning here."""
    size, file_offset, device_ptr = _ints("hostbuf_file_reader_read", size, file_offset, device_ptr)
    if size < 0 or file_offset < 0:
        raise RuntimeError("hostbuf_file_reader_read failed")
    if size == 0 or _from_vram(file_obj, file_offset, size, device_ptr, device):
        return
    try:
        bounce = mmap.mmap(-1, size)
    except (OSError, ValueError, OverflowError, MemoryError) as exc:
        raise RuntimeError(f"hostbuf_file_reader_read failed ({exc})") from None
    try:
        _read_into(file_obj, memoryview(bounce), file_offset, "hostbuf_file_reader_read")
        _to_device(_address(bounce), size, device_ptr, device)
        _read_to_device(file_obj, file_offset, size, device_ptr)
    finally:
        try:
            bounce.close()
        except BufferError:  # a view still exported: the map goes with the last reference
            pass


def cleanup_file_reader():
    """comfy-aimdo's ``host_buffer.cleanup_file_reader``: nothing is staged, nothing to give back."""


class ModelMMAP:
    """comfy-aimdo's ``ModelMMAP(filepath)``: a private memory map of the file."""

    def __init__(self, filepath):
        try:
            with open(os.fspath(filepath), "rb") as f:
                self._fd: int | None = os.dup(f.fileno())
                self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"ModelMMAP allocation failed for {filepath} ({exc})") from None
        self._addr = _address(self._map)

    def get(self):
        return self._addr

    def get_file_handle(self):
        return self._fd

    def bounce(self):
        try:
            self._map.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError):
            return False
        return True

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
            self._fd = None
