"""CUDA driver wrapper over cuda-python's ``cuda.bindings.driver`` (or a simulation of it).

Calls follow the CUDA driver API's virtual memory management: address ranges
from ``cuMemAddressReserve``, physical memory from ``cuMemCreate`` (pinned,
on one device), ``cuMemMap`` + ``cuMemSetAccess`` to back a range,
``cuMemUnmap`` + ``cuMemRelease`` to drop it. Each device is used through its
primary context, made current with ``cuCtxSetCurrent`` before every call that
touches it (comfy-aimdo does not, which breaks a second device).
"""

from __future__ import annotations

from typing import Any

from .gpu import GpuDriver

__all__ = ["CudaDriver"]


def _import_driver() -> Any:
    from cuda.bindings import driver  # the `cuda` extra

    return driver


class CudaDriver(GpuDriver):
    vendor = "cuda"

    def __init__(self, module: Any = None, label: str | None = None):
        module = module if module is not None else _import_driver()
        super().__init__(module, label or getattr(module, "label", "cuda-python"))
        d = self.m
        self.SUCCESS = d.CUresult.CUDA_SUCCESS
        self.OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        self.NOT_READY = d.CUresult.CUDA_ERROR_NOT_READY
        self._contexts: dict[int, Any] = {}
        self._props: dict[int, Any] = {}

    def init(self) -> None:
        self.call("cuInit", 0)

    def device_count(self) -> int:
        return int(self.call("cuDeviceGetCount")[0])

    def _device(self, index: int) -> Any:
        return self.call("cuDeviceGet", index)[0]

    def set_device(self, index: int) -> None:
        ctx = self._contexts.get(index)
        if ctx is None:
            ctx = self._contexts[index] = self.call("cuDevicePrimaryCtxRetain", self._device(index))[0]
        self.call("cuCtxSetCurrent", ctx)

    def current_device(self) -> int:
        return int(self.call("cuCtxGetDevice")[0])

    def total_mem(self, index: int) -> int:
        return int(self.call("cuDeviceTotalMem", self._device(index))[0])

    def name(self, index: int) -> str:
        raw = self.call("cuDeviceGetName", 256, self._device(index))[0]
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\0")[0]

    def attribute(self, index: int, attribute: Any) -> int:
        return int(self.call("cuDeviceGetAttribute", attribute, self._device(index))[0])

    def integrated(self, index: int) -> bool:
        return bool(self.attribute(index, self.m.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED))

    def arch(self, index: int) -> str:
        a = self.m.CUdevice_attribute
        major = self.attribute(index, a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self.attribute(index, a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        return f"sm_{major}{minor}"

    def driver_model(self, index: int, os_name: str | None = None) -> str | None:
        """"tcc" or "wddm" on Windows (CU_DEVICE_ATTRIBUTE_TCC_DRIVER), None elsewhere."""
        import sys

        if (os_name or ("windows" if sys.platform == "win32" else "")) != "windows":
            return None
        tcc = self.attribute(index, self.m.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_TCC_DRIVER)
        return "tcc" if tcc else "wddm"

    def luid(self, index: int) -> tuple[int, int]:
        """The adapter LUID of the device (Windows; what DXGI knows the adapter by)."""
        from .dxgi import luid_from_bytes

        raw = self.call("cuDeviceGetLuid", self._device(index))[0]
        return luid_from_bytes(bytes(raw))

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
        return int(self.call("cuMemAddressReserve", size, alignment, 0, 0)[0])

    def address_free(self, ptr: int, size: int) -> None:
        self.call("cuMemAddressFree", self.m.CUdeviceptr(ptr), size)

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
        free, total = self.call("cuMemGetInfo")
        return int(free), int(total)

    def event_create(self) -> Any:
        return self.call("cuEventCreate", self.m.CUevent_flags.CU_EVENT_DISABLE_TIMING)[0]

    def event_record(self, event: Any, stream: Any) -> None:
        self.call("cuEventRecord", event, stream)

    def event_query(self, event: Any) -> bool:
        return self._query("cuEventQuery", event)

    def event_synchronize(self, event: Any) -> None:
        self.call("cuEventSynchronize", event)

    def event_destroy(self, event: Any) -> None:
        self.call("cuEventDestroy", event)

    def stream_create(self) -> Any:
        return self.call("cuStreamCreate", 0)[0]

    def stream_synchronize(self, stream: Any) -> None:
        self.call("cuStreamSynchronize", stream)

    def device_synchronize(self) -> None:
        self.call("cuCtxSynchronize")

    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Any) -> None:
        self.call("cuMemcpyHtoDAsync", self.m.CUdeviceptr(dst), src, size, stream)

    # plain (non-VMM) memory, for baselines and staging buffers
    def mem_alloc(self, size: int) -> int:
        return int(self.call("cuMemAlloc", size)[0])

    def mem_free(self, ptr: int) -> None:
        self.call("cuMemFree", self.m.CUdeviceptr(ptr))

    def host_alloc_pinned(self, size: int) -> int:
        return int(self.call("cuMemAllocHost", size)[0])

    def host_free_pinned(self, ptr: int) -> None:
        self.call("cuMemFreeHost", ptr)
