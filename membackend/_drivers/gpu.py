"""The one shape every GPU driver wrapper has (CUDA, HIP, and the simulations of both).

A wrapper takes the driver module as a parameter (``cuda.bindings.driver``,
``hip.hip``, the ctypes binding :mod:`membackend._drivers.hip_ctypes` or a
simulated module with the same names), calls exactly what discovery and the
VMM backend need, and turns every non-success code into
:class:`~membackend.types.DriverError` with the code and the call's name. A
module that cannot even be called (cuda-python with no driver installed
raises instead of returning a code) gives ``DriverError("unavailable", ...)``.

**The caller's current device stays as it was.** The CUDA context or HIP
device current on a thread is what torch's ``current_device()`` and ComfyUI
read (CUDA driver API reference, ``cuCtxSetCurrent``: it "binds the specified
CUDA context to the calling CPU thread"; HIP runtime API, ``hipSetDevice``:
"sets device as the default device for the calling host thread"). So
:meth:`GpuDriver.set_device` only *selects* the device that this wrapper's
later calls on this thread run on; each call that needs a current device
saves the thread's, switches only if it differs, and switches back before it
returns (:meth:`GpuDriver.on_device`). :meth:`GpuDriver.close` releases what
the wrapper retained (the CUDA primary contexts).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from ..types import DriverError

__all__ = ["GpuDriver", "EventToken", "BUDGET_SOURCES", "host_address", "nofile_limits", "process_descriptors"]

#: where a platform's budget can come from (see :meth:`GpuDriver.budget`)
BUDGET_SOURCES = ("device", "wddm", "unified", "apu")


def host_address(x: Any) -> int:
    """A host pointer as cuda-python and hip-python take one: an int (an address), a ctypes object
    (its address), a buffer-protocol object such as ``bytearray`` (its first byte), or None (NULL)."""
    if x is None:
        return 0
    if isinstance(x, int):
        return x
    if isinstance(x, ctypes._SimpleCData) and not isinstance(x, ctypes.c_void_p):
        return ctypes.addressof(x)
    if isinstance(x, ctypes.c_void_p):
        return x.value or 0
    if isinstance(x, (ctypes.Array, ctypes.Structure)):
        return ctypes.addressof(x)
    if isinstance(x, bytes):  # the object's own storage (c_char_p does not copy a bytes object)
        return ctypes.cast(ctypes.c_char_p(x), ctypes.c_void_p).value or 0
    try:
        view = memoryview(x)
    except TypeError:
        return int(x)
    if view.readonly:
        raise TypeError(f"a read-only {type(x).__name__} has no address to hand to the driver; pass bytes, "
                        "a bytearray, a ctypes buffer or an address")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def nofile_limits() -> tuple[int | None, int | None] | None:
    """This process's descriptor limits, ``(soft, hard)`` of ``RLIMIT_NOFILE`` (None for either: no limit);
    None where the OS has no such limit to read (Windows: no ``resource`` module)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    infinite = resource.RLIM_INFINITY
    return (None if soft == infinite else soft), (None if hard == infinite else hard)


def process_descriptors() -> int | None:
    """The file descriptors this process has open now: the entries of ``/proc/self/fd`` (``/dev/fd`` where
    there is no ``/proc``) less the one the listing itself opened; a listing refused with ``EMFILE`` means every
    descriptor the soft limit allows is open. None where none can be listed (Windows)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(folder)) - 1)
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                limits = nofile_limits()
                return limits[0] if limits is not None else None
    return None


class GpuDriver:
    """Base of :class:`~membackend._drivers.cuda.CudaDriver` and :class:`~membackend._drivers.hip.HipDriver`.

    Subclasses set ``vendor`` and the vendor's codes (``SUCCESS``, ``OOM``,
    ``NOT_READY``), implement the methods below with their own API names, and
    say how to read, set and restore the thread's current device
    (:meth:`_switch_to`, :meth:`_restore`). Budget sources (:meth:`budget`)
    sit behind the same interface, so a simulated driver can answer each from
    its own model of the platform.
    """

    vendor = ""
    #: True for a simulated twin (the only place the layers above learn it: a probe's reason says so)
    simulated = False

    @property
    def cpu_addressable(self) -> bool:
        """True where device memory is ordinary memory of this process that the CPU reads and writes at the
        same addresses (a simulated device that holds its bytes): torch views it as a CPU tensor then."""
        return False

    def memory_note(self) -> str | None:
        """Where this driver's device memory lives, when that is worth a line in the doctor (a simulated
        driver's bytes: memory of this process, or books only and why); None for a real driver."""
        return None

    def open_descriptors(self) -> int | None:
        """The file descriptors the process holds now, the driver's own among them (ROCm 7.14 holds one per
        live handle): :func:`process_descriptors`. None where they cannot be counted."""
        return process_descriptors()
    SUCCESS: Any = 0
    OOM: Any = 2
    NOT_READY: Any = 600

    def __init__(self, module: Any, label: str):
        self.m = module
        self.label = label
        self._selected = threading.local()  # per thread: the device set_device chose

    def call(self, name: str, *args: Any) -> tuple:
        """Call ``name`` and return the values after the status code; raise on failure."""
        try:
            result = getattr(self.m, name)(*args)
        except Exception as exc:  # no driver library, bad argument types: the call never ran
            raise DriverError("unavailable", name, f"{type(exc).__name__}: {exc}") from exc
        status = result[0] if isinstance(result, tuple) else result
        if status != self.SUCCESS:
            raise DriverError(status, name)
        return result[1:] if isinstance(result, tuple) else ()

    def is_oom(self, exc: DriverError) -> bool:
        return exc.code == self.OOM

    # ------------------------------------------------------------------ the device a call runs on

    def set_device(self, index: int) -> None:
        """Select device ``index`` for this thread's following calls through this wrapper.

        The thread's current device or context is not changed: each call that
        needs one makes the selected device current and the caller's current
        again afterwards. A bad index fails at the next such call, as the
        driver's own check.
        """
        self._selected.index = index

    def selected_device(self) -> int | None:
        """The device :meth:`set_device` selected on this thread, or None."""
        return getattr(self._selected, "index", None)

    @contextmanager
    def on_device(self, index: int | None = None) -> Iterator[None]:
        """Run the block with device ``index`` (default: the selected one) current on this thread,
        then make the caller's device or context current again, also when the block raised (its
        error wins over a failed restore)."""
        saved = self._switch_to(self.selected_device() if index is None else index)
        try:
            yield
        except BaseException:
            if saved is not None:
                try:
                    self._restore(saved)
                except DriverError:
                    pass
            raise
        if saved is not None:
            self._restore(saved)

    def _switch_to(self, index: int | None) -> Any:
        """Make device ``index`` current on this thread if it is not (None: leave the thread's
        current device, or the vendor's default where there is none); return what to restore,
        or None when nothing changed."""
        raise NotImplementedError

    def _restore(self, saved: Any) -> None:
        raise NotImplementedError

    def _on(self, name: str, *args: Any) -> tuple:
        """:meth:`call` with the selected device current, the caller's current again after it."""
        with self.on_device():
            return self.call(name, *args)

    def close(self) -> None:
        """Release what this wrapper retained (CUDA: the primary contexts). The wrapper may be used
        again afterwards and retains again then. Raises ``DriverError`` when a release fails."""

    # ------------------------------------------------------------------ discovery (no context needed)

    def driver_version(self) -> int:
        """The installed driver's version number (``cuDriverGetVersion``, ``hipDriverGetVersion``)."""
        raise NotImplementedError

    def vmm_supported(self, index: int) -> bool:
        """Whether device ``index`` supports virtual memory management (address reserve, create, map)."""
        raise NotImplementedError

    # the interface; each returns plain Python ints where it returns anything
    def init(self) -> None: raise NotImplementedError
    def device_count(self) -> int: raise NotImplementedError
    def current_device(self) -> int: raise NotImplementedError
    def total_mem(self, index: int) -> int: raise NotImplementedError
    def name(self, index: int) -> str: raise NotImplementedError
    def integrated(self, index: int) -> bool: raise NotImplementedError
    def arch(self, index: int) -> str: raise NotImplementedError
    def driver_model(self, index: int, os_name: str | None = None) -> str | None: raise NotImplementedError
    def granularity(self, index: int) -> int: raise NotImplementedError
    def address_reserve(self, size: int, alignment: int) -> int: raise NotImplementedError
    def address_free(self, ptr: int, size: int) -> None: raise NotImplementedError
    def create(self, size: int, index: int) -> Any: raise NotImplementedError
    def release(self, handle: Any) -> None: raise NotImplementedError
    def map(self, ptr: int, size: int, handle: Any) -> None: raise NotImplementedError
    def unmap(self, ptr: int, size: int) -> None: raise NotImplementedError
    def set_access(self, ptr: int, size: int, index: int) -> None: raise NotImplementedError
    def mem_get_info(self) -> tuple[int, int]: raise NotImplementedError
    def event_create(self) -> Any: raise NotImplementedError
    def event_record(self, event: Any, stream: Any) -> None: raise NotImplementedError
    def event_query(self, event: Any) -> bool: raise NotImplementedError
    def event_synchronize(self, event: Any) -> None: raise NotImplementedError
    def event_destroy(self, event: Any) -> None: raise NotImplementedError
    def stream_create(self) -> Any: raise NotImplementedError
    def stream_synchronize(self, stream: Any) -> None: raise NotImplementedError
    def device_synchronize(self) -> None: raise NotImplementedError
    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Any) -> None: raise NotImplementedError
    def memcpy_htod(self, dst: int, src: Any, size: int) -> None: raise NotImplementedError
    def memcpy_dtoh(self, dst: Any, src: int, size: int) -> None: raise NotImplementedError
    def luid(self, index: int) -> tuple[int, int]: raise NotImplementedError

    def host_unregister(self, ptr: int) -> bool:
        """End the page-locking of the host range registered at ``ptr`` (by ``cuMemHostRegister`` /
        ``hipHostRegister``, or torch's ``cudaHostRegister``): True when one started there, False when none
        did. Leaves no error in the runtime API's per-thread last error, which torch checks."""
        raise NotImplementedError

    # ------------------------------------------------------------------ budget sources

    def budget(self, source: str, index: int) -> tuple[int, int, str]:
        """``(total, free, label)`` of device ``index`` from one of :data:`BUDGET_SOURCES`.

        * ``device``: the driver's mem-get-info for the device (current for the call only);
        * ``wddm``: the WDDM video-memory budget of this process minus its current
          usage (DXGI ``QueryVideoMemoryInfo``; Windows only), so what is reported
          free never spills into shared system memory;
        * ``unified``: one pool shared with the host: ``MemAvailable`` capped by the
          memory cgroup (reclaimable page cache counts; ``MemFree`` would not).
        * ``apu``: an AMD APU's one pool: the smallest of mem-get-info's free (never
          above its own total), what sysfs's carve-out and GTT leave, and the host's
          ``MemAvailable`` less a reserve for the system (:mod:`.apu`); the label
          names all three and the one that bound.
        """
        if source == "device":
            with self.on_device(index):
                free, total = self.mem_get_info()
            call = "cuMemGetInfo" if self.vendor == "cuda" else "hipMemGetInfo"
            return total, free, f"{call} ({self.label})"
        if source == "wddm":
            from .dxgi import query_video_memory

            info = query_video_memory(self.luid(index))
            return info.budget, max(0, info.budget - info.current_usage), "DXGI QueryVideoMemoryInfo budget"
        if source == "unified":
            from .._hostmem import host_memory

            pool = host_memory()
            return pool.total, pool.available, f"unified pool: {pool.source}"
        if source == "apu":
            from .apu import apu_pool

            with self.on_device(index):
                free, total = self.mem_get_info()
            ram_total, ram_available = self.host_ram()
            apu = apu_pool(free, total, "hipMemGetInfo" if self.vendor == "hip" else "cuMemGetInfo",
                           self.amdgpu_memory(index), ram_total, ram_available)
            return apu.total, apu.free, apu.label
        raise DriverError("invalid", "budget", f"unknown budget source {source!r}; accepted: {', '.join(BUDGET_SOURCES)}")

    def host_ram(self) -> tuple[int, int]:
        """The host's own ``MemTotal`` and ``MemAvailable`` (no cgroup cap), for the ``apu`` source."""
        from .._hostmem import host_memory

        host = host_memory()
        return host.ram_total, host.ram_available

    def pci_location(self, index: int) -> tuple[int, int, int] | None:
        """(domain, bus, device) of device ``index``'s PCI function; None where the driver cannot say."""
        return None

    def amdgpu_memory(self, index: int) -> Any:
        """The amdgpu driver's sysfs memory files of device ``index`` (an :class:`.apu.AmdgpuMemory`), or None
        where there are none (another driver, no PCI location, no sysfs)."""
        from .apu import read_amdgpu_memory

        where = self.pci_location(index)
        return None if where is None else read_amdgpu_memory(*where)

    # ------------------------------------------------------------------ checking seams (simulated drivers only)

    def inspect(self, index: int) -> dict[str, int] | None:
        """The driver's own tables for device ``index`` (reserved, mapped, physical bytes); None when
        the driver cannot be asked, as with the real CUDA and HIP drivers."""
        return None

    def inject_failures(self, probability: float, seed: int) -> Any:
        """Fail VMM calls at random from now on; None when the driver cannot (real drivers)."""
        return None

    def _query(self, name: str, event: Any) -> bool:
        """Event queries answer "not ready" with a status code that is no failure."""
        try:
            self.call(name, event)
        except DriverError as exc:
            if exc.code == self.NOT_READY:
                return False
            raise
        return True


class EventToken:
    """A fence token (``done()``/``wait()``) over an event recorded on a stream; destroys it once waited.

    Queried, waited for and destroyed with the event's own device current (the server thread's ``/free``
    and a copy thread wait on tokens of any device), and the caller's current again afterwards.

    Safe to share between threads: the event is queried, waited for and
    destroyed under the token's own lock, so it is destroyed exactly once.
    """

    __slots__ = ("driver", "event", "device", "_done", "_lock")

    def __init__(self, driver: GpuDriver, event: Any, device: int):
        self.driver, self.event, self.device, self._done = driver, event, device, False
        self._lock = threading.Lock()

    def done(self) -> bool:
        if self._done:
            return True
        with self._lock, self.driver.on_device(self.device):  # the event's device, whichever thread asks
            if not self._done and self.driver.event_query(self.event):
                self._finish()
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        with self._lock, self.driver.on_device(self.device):
            if not self._done:
                self.driver.event_synchronize(self.event)
                self._finish()

    def _finish(self) -> None:
        self._done = True
        self.driver.event_destroy(self.event)

    def __repr__(self) -> str:
        return f"EventToken(device={self.device}, done={self._done})"
