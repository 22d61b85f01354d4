"""CUDA driver wrapper over cuda-python's ``cuda.bindings.driver`` (or a simulation of it).

Calls follow the CUDA driver API's virtual memory management: address ranges
from ``cuMemAddressReserve``, physical memory from ``cuMemCreate`` (pinned,
on one device), ``cuMemMap`` + ``cuMemSetAccess`` to back a range,
``cuMemUnmap`` + ``cuMemRelease`` to drop it. Those calls name their device
in their arguments and need no current context (their documented return codes
include no ``CUDA_ERROR_INVALID_CONTEXT``); the calls that do (mem-get-info,
streams, events, copies, ``cuCtxSynchronize``) run with the selected device's
primary context current and the caller's context current again afterwards
(``cuCtxGetCurrent`` / ``cuCtxSetCurrent``). Primary contexts are retained
once per device (``cuDevicePrimaryCtxRetain``) and released by :meth:`close`
(``cuDevicePrimaryCtxRelease``); comfy-aimdo switches contexts without
restoring them, which moves torch to the last device it touched.

Discovery (:meth:`name`, :meth:`total_mem`, :meth:`attribute` and what is
built on it, :meth:`luid`, :meth:`driver_version`) needs ``cuInit`` only: no
context is created, and the driver lists only the devices
``CUDA_VISIBLE_DEVICES`` leaves visible.

The names used exist in cuda-python 12.x and 13.x alike (``cuDeviceTotalMem``,
``cuMemGetInfo``, ``cuDevicePrimaryCtxRelease``, ``cuEventDestroy`` are the
unsuffixed names both export for the ``_v2`` entry points); releases before
12.6 have the module as ``cuda.cuda`` instead of ``cuda.bindings.driver``.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from ..types import DriverError
from .gpu import GpuDriver

__all__ = ["CudaDriver"]


def _import_driver() -> Any:
    try:
        from cuda.bindings import driver  # the `cuda` extra (cuda-python 12.6 and later)
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6
        except ImportError:
            raise ImportError("cuda-python is not installed (no cuda.bindings.driver, no cuda.cuda)") from None
    return driver


def _version_label() -> str:
    try:
        import importlib.metadata

        return f"cuda-python {importlib.metadata.version('cuda-bindings')}"
    except Exception:
        try:
            return f"cuda-python {importlib.metadata.version('cuda-python')}"
        except Exception:
            return "cuda-python"


class CudaDriver(GpuDriver):
    vendor = "cuda"

    def __init__(self, module: Any = None, label: str | None = None):
        real = module is None
        module = _import_driver() if real else module
        super().__init__(module, label or getattr(module, "label", None) or (_version_label() if real else "cuda"))
        d = self.m
        self.SUCCESS = d.CUresult.CUDA_SUCCESS
        self.OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        self.NOT_READY = d.CUresult.CUDA_ERROR_NOT_READY
        self._contexts: dict[int, Any] = {}  # device index -> its retained primary context
        self._retain_lock = threading.Lock()  # one retain per device, whichever thread asks first
        self._props: dict[int, Any] = {}

    def init(self) -> None:
        self.call("cuInit", 0)

    def device_count(self) -> int:
        return int(self.call("cuDeviceGetCount")[0])

    def driver_version(self) -> int:
        """``cuDriverGetVersion``: 1000 x major + 10 x minor (12080 is CUDA 12.8)."""
        return int(self.call("cuDriverGetVersion")[0])

    def _device(self, index: int) -> Any:
        return self.call("cuDeviceGet", index)[0]

    # ------------------------------------------------------------------ contexts

    def _context(self, index: int) -> Any:
        ctx = self._contexts.get(index)
        if ctx is None:
            with self._retain_lock:
                ctx = self._contexts.get(index)
                if ctx is None:
                    ctx = self._contexts[index] = self.call("cuDevicePrimaryCtxRetain", self._device(index))[0]
        return ctx

    def current_context(self) -> int:
        """The calling thread's current context as an int handle (0: none is current)."""
        return int(self.call("cuCtxGetCurrent")[0])

    def _switch_to(self, index: int | None) -> Any:
        current = self.call("cuCtxGetCurrent")[0]
        if index is None:
            if int(current):
                return None  # the caller's context serves
            index = 0  # none current: the device the runtime API would pick
        want = self._context(index)
        if int(current) == int(want):
            return None
        self.call("cuCtxSetCurrent", want)
        return current  # may be the NULL context: restoring it unbinds ours again

    def _restore(self, saved: Any) -> None:
        self.call("cuCtxSetCurrent", saved)

    def close(self) -> None:
        """``cuDevicePrimaryCtxRelease`` once for every primary context this wrapper retained."""
        failed = None
        with self._retain_lock:
            for index in sorted(self._contexts):
                try:
                    self.call("cuDevicePrimaryCtxRelease", self._device(index))
                except Exception as exc:  # keep releasing the others
                    failed = failed or exc
                del self._contexts[index]
        if failed is not None:
            raise failed

    def current_device(self) -> int:
        """The device of the calling thread's current context (``cuCtxGetDevice``)."""
        return int(self.call("cuCtxGetDevice")[0])

    # ------------------------------------------------------------------ discovery

    def total_mem(self, index: int) -> int:
        return int(self.call("cuDeviceTotalMem", self._device(index))[0])

    def name(self, index: int) -> str:
        raw = self.call("cuDeviceGetName", 256, self._device(index))[0]
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\0")[0]

    def attribute(self, index: int, attribute: Any) -> int:
        """``cuDeviceGetAttribute`` of device ``index``; ``attribute`` is a ``CUdevice_attribute``
        or its name without the ``CU_DEVICE_ATTRIBUTE_`` prefix."""
        if isinstance(attribute, str):
            attribute = getattr(self.m.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attribute}")
        return int(self.call("cuDeviceGetAttribute", attribute, self._device(index))[0])

    def integrated(self, index: int) -> bool:
        """CU_DEVICE_ATTRIBUTE_INTEGRATED (18): the GPU shares the host's memory (GB10, Jetson)."""
        return bool(self.attribute(index, "INTEGRATED"))

    def vmm_supported(self, index: int) -> bool:
        """CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102); without it ``cuMemCreate``
        fails with CUDA_ERROR_NOT_SUPPORTED."""
        return bool(self.attribute(index, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))

    def arch(self, index: int) -> str:
        """``sm_<major><minor>`` from CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR/MINOR (75, 76)."""
        major = self.attribute(index, "COMPUTE_CAPABILITY_MAJOR")
        minor = self.attribute(index, "COMPUTE_CAPABILITY_MINOR")
        return f"sm_{major}{minor}"

    def driver_model(self, index: int, os_name: str | None = None) -> str | None:
        """"tcc" or "wddm" on Windows (CU_DEVICE_ATTRIBUTE_TCC_DRIVER, 35: 1 for TCC and MCDM,
        0 for WDDM), None on any other OS (``os_name``, default: this process's)."""
        import sys

        if (os_name or ("windows" if sys.platform == "win32" else "")) != "windows":
            return None
        return "tcc" if self.attribute(index, "TCC_DRIVER") else "wddm"

    def pci_location(self, index: int) -> tuple[int, int, int]:
        """(domain, bus, device) from CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID/BUS_ID/DEVICE_ID (50, 33, 34),
        which is how NVML's devices are matched to CUDA's (their orders differ)."""
        return (self.attribute(index, "PCI_DOMAIN_ID"), self.attribute(index, "PCI_BUS_ID"),
                self.attribute(index, "PCI_DEVICE_ID"))

    def luid(self, index: int) -> tuple[int, int]:
        """The adapter LUID of the device (``cuDeviceGetLuid``; Windows, what DXGI knows the adapter by).

        Asked through ctypes when the real driver library is loaded: cuda-python (12.9, 13.4) returns the
        ``char[8]`` as a NUL-terminated string, so a LUID with a zero byte -- its high part is usually 0 --
        comes back short (or runs on past the eighth byte when it has none)."""
        from .dxgi import luid_from_bytes

        dev = self._device(index)
        lib = self._driver_library()
        if lib is None:  # a simulated driver module answers whole bytes
            return luid_from_bytes(bytes(self.call("cuDeviceGetLuid", dev)[0]))
        raw, mask = ctypes.create_string_buffer(8), ctypes.c_uint(0)
        status = lib.cuDeviceGetLuid(raw, ctypes.byref(mask), ctypes.c_int(int(dev)))
        if status != 0:
            raise DriverError(status, "cuDeviceGetLuid")
        return luid_from_bytes(raw.raw)

    def _driver_library(self) -> Any:
        """The CUDA driver library cuda-python loaded (the same handle, by its name), or None when this
        wrapper runs over a simulated module."""
        if not getattr(self.m, "__name__", "").startswith("cuda"):
            return None
        try:
            return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        except OSError:
            return None

    def _prop(self, index: int) -> Any:
        prop = self._props.get(index)
        if prop is None:
            d = self.m
            prop = d.CUmemAllocationProp()
            prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = index
            self._props[index] = prop
        return prop

    def granularity(self, index: int) -> int:
        option = self.m.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self.call("cuMemGetAllocationGranularity", self._prop(index), option)[0])

    def address_reserve(self, size: int, alignment: int) -> int:
        """Reserved with the selected device current (once per reservation, off the hot path), so a
        range belongs to the device the caller chose in the driver's and a simulation's books."""
        return int(self._on("cuMemAddressReserve", size, alignment, 0, 0)[0])

    def address_free(self, ptr: int, size: int) -> None:
        self._on("cuMemAddressFree", self.m.CUdeviceptr(ptr), size)

    def create(self, size: int, index: int) -> Any:
        return self.call("cuMemCreate", size, self._prop(index), 0)[0]

    def release(self, handle: Any) -> None:
        self.call("cuMemRelease", handle)

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self.call("cuMemMap", self.m.CUdeviceptr(ptr), size, 0, handle, 0)

    def unmap(self, ptr: int, size: int) -> None:
        self.call("cuMemUnmap", self.m.CUdeviceptr(ptr), size)

    def set_access(self, ptr: int, size: int, index: int) -> None:
        d = self.m
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.call("cuMemSetAccess", d.CUdeviceptr(ptr), size, [desc], 1)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._on("cuMemGetInfo")
        return int(free), int(total)

    def event_create(self) -> Any:
        return self._on("cuEventCreate", self.m.CUevent_flags.CU_EVENT_DISABLE_TIMING)[0]

    def event_record(self, event: Any, stream: Any) -> None:
        self._on("cuEventRecord", event, stream)

    def event_query(self, event: Any) -> bool:
        return self._query("cuEventQuery", event)

    def event_synchronize(self, event: Any) -> None:
        """With a context current: the selected device's, or (none selected) the thread's own, which
        ``EventToken`` makes the event's device."""
        self._on("cuEventSynchronize", event)

    def event_destroy(self, event: Any) -> None:
        """As :meth:`event_synchronize`."""
        self._on("cuEventDestroy", event)

    def stream_create(self) -> Any:
        return self._on("cuStreamCreate", 0)[0]

    def stream_synchronize(self, stream: Any) -> None:
        self._on("cuStreamSynchronize", stream)

    def device_synchronize(self) -> None:
        self._on("cuCtxSynchronize")

    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Any) -> None:
        self._on("cuMemcpyHtoDAsync", self.m.CUdeviceptr(dst), src, size, stream)

    def memcpy_htod(self, dst: int, src: Any, size: int) -> None:
        """Synchronous host-to-device copy (after the work queued before it)."""
        self._on("cuMemcpyHtoD", self.m.CUdeviceptr(dst), src, size)

    def memcpy_dtoh(self, dst: Any, src: int, size: int) -> None:
        """Synchronous device-to-host copy (after the work queued before it)."""
        self._on("cuMemcpyDtoH", dst, self.m.CUdeviceptr(src), size)

    # plain (non-VMM) memory, for baselines and staging buffers
    def mem_alloc(self, size: int) -> int:
        return int(self._on("cuMemAlloc", size)[0])

    def mem_free(self, ptr: int) -> None:
        self._on("cuMemFree", self.m.CUdeviceptr(ptr))

    def host_alloc_pinned(self, size: int) -> int:
        return int(self._on("cuMemAllocHost", size)[0])

    def host_free_pinned(self, ptr: int) -> None:
        self._on("cuMemFreeHost", ptr)

    def host_unregister(self, ptr: int) -> bool:
        """``cuMemHostUnregister`` of the range page-locked at ``ptr`` (by ``cuMemHostRegister`` or the
        runtime's ``cudaHostRegister``, one set of registrations): True when one started there, False when
        none did (``CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED``). A driver-API call, so a refusal leaves nothing
        in the runtime API's per-thread last error, which torch reads after its kernel launches."""
        try:
            self._on("cuMemHostUnregister", ptr)
        except DriverError as exc:
            if exc.code == self.m.CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
                return False
            raise
        return True
