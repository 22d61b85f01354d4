"""A simulated ``cuda.bindings.driver``: the same function names, argument order, return
tuples, enums and structs as cuda-python (which it imports for its types), over a
:class:`~membackend.drivers.sim.platform.SimPlatform`.
"""

from __future__ import annotations

from typing import Any

from .api import SimApi
from .platform import SimError, SimPlatform

__all__ = ["SimCudaDriverModule"]


def _bindings() -> Any:
    from cuda.bindings import driver

    return driver


def _int(x: Any) -> int:
    return 0 if x is None else int(x)


class SimCudaDriverModule(SimApi):
    success = "CUDA_SUCCESS"
    status_enum = "CUresult"
    kinds = {"oom": "CUDA_ERROR_OUT_OF_MEMORY", "invalid": "CUDA_ERROR_INVALID_VALUE",
             "invalid_device": "CUDA_ERROR_INVALID_DEVICE", "not_ready": "CUDA_ERROR_NOT_READY"}

    def __init__(self, platform: SimPlatform):
        self.types = _bindings()
        super().__init__(platform)

    # devices and contexts
    def cuInit(self, Flags):
        return self._run("cuInit", 0, self.platform.init)

    def cuDeviceGetCount(self):
        return self._run("cuDeviceGetCount", 1, lambda: len(self.platform.devices))

    def cuDeviceGet(self, ordinal):
        return self._run("cuDeviceGet", 1, lambda: self.types.CUdevice(self.platform._device(ordinal).index))

    def cuDeviceTotalMem(self, dev):
        return self._run("cuDeviceTotalMem", 1, lambda: self.platform._device(_int(dev)).vram)

    def cuDeviceGetName(self, length, dev):
        return self._run("cuDeviceGetName", 1, lambda: self.platform._device(_int(dev)).name.encode()[:length])

    def cuDeviceGetAttribute(self, attrib, dev):
        a = self.types.CUdevice_attribute

        def get():
            d = self.platform._device(_int(dev))
            major, minor = (int(d.arch[3:-1] or 0), int(d.arch[-1])) if d.arch.startswith("sm_") else (0, 0)
            return {a.CU_DEVICE_ATTRIBUTE_INTEGRATED: int(d.integrated),
                    a.CU_DEVICE_ATTRIBUTE_TCC_DRIVER: int(not self.platform.profile.wddm and
                                                          self.platform.profile.os == "windows"),
                    a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: major,
                    a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: minor}.get(attrib, 0)
        return self._run("cuDeviceGetAttribute", 1, get)

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._run("cuDevicePrimaryCtxRetain", 1,
                         lambda: self.types.CUcontext(self.platform._device(_int(dev)).index + 1))

    def cuCtxSetCurrent(self, ctx):
        return self._run("cuCtxSetCurrent", 0, lambda: self.platform.set_current(_int(ctx) - 1))

    def cuCtxGetDevice(self):
        return self._run("cuCtxGetDevice", 1, lambda: self.types.CUdevice(self.platform.current))

    def cuCtxSynchronize(self):
        return self._run("cuCtxSynchronize", 0, self.platform.device_synchronize)

    def cuMemGetInfo(self):
        return self._run("cuMemGetInfo", 2, self.platform.mem_get_info)

    # virtual memory management
    def cuMemGetAllocationGranularity(self, prop, option):
        return self._run("cuMemGetAllocationGranularity", 1, lambda: self.platform.profile.granularity)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        return self._run("cuMemAddressReserve", 1,
                         lambda: self.types.CUdeviceptr(self.platform.address_reserve(size, alignment)))

    def cuMemAddressFree(self, ptr, size):
        return self._run("cuMemAddressFree", 0, lambda: self.platform.address_free(_int(ptr), size))

    def cuMemCreate(self, size, prop, flags):
        return self._run("cuMemCreate", 1, lambda: self.types.CUmemGenericAllocationHandle(
            self.platform.create(size, int(prop.location.id))))

    def cuMemRelease(self, handle):
        return self._run("cuMemRelease", 0, lambda: self.platform.release(_int(handle)))

    def cuMemMap(self, ptr, size, offset, handle, flags):
        return self._run("cuMemMap", 0, lambda: self.platform.map(_int(ptr), size, offset, _int(handle)))

    def cuMemUnmap(self, ptr, size):
        return self._run("cuMemUnmap", 0, lambda: self.platform.unmap(_int(ptr), size))

    def cuMemSetAccess(self, ptr, size, desc, count):
        return self._run("cuMemSetAccess", 0,
                         lambda: self.platform.set_access(_int(ptr), size, int(desc[0].location.id)))

    # streams, events, copies
    def cuStreamCreate(self, Flags):
        return self._run("cuStreamCreate", 1, lambda: self.types.CUstream(self.platform.stream_create()))

    def cuStreamSynchronize(self, hStream):
        return self._run("cuStreamSynchronize", 0, lambda: self.platform.stream_synchronize(_int(hStream)))

    def cuEventCreate(self, Flags):
        return self._run("cuEventCreate", 1, lambda: self.types.CUevent(self.platform.event_create()))

    def cuEventRecord(self, hEvent, hStream):
        return self._run("cuEventRecord", 0, lambda: self.platform.event_record(_int(hEvent), _int(hStream)))

    def cuEventQuery(self, hEvent):
        def query():
            if not self.platform.event_query(_int(hEvent)):
                raise SimError("not_ready", "work before the event is still running")
        return self._run("cuEventQuery", 0, query)

    def cuEventSynchronize(self, hEvent):
        return self._run("cuEventSynchronize", 0, lambda: self.platform.event_synchronize(_int(hEvent)))

    def cuEventDestroy(self, hEvent):
        return self._run("cuEventDestroy", 0, lambda: self.platform.event_destroy(_int(hEvent)))

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream):
        return self._run("cuMemcpyHtoDAsync", 0,
                         lambda: self.platform.copy_async(_int(dstDevice), ByteCount, _int(hStream)))

    def cuMemAllocHost(self, bytesize):
        def alloc():
            self.platform.host_alloc(bytesize)
            return bytesize  # the sim has no host addresses; the size stands in for the pointer
        return self._run("cuMemAllocHost", 1, alloc)

    def cuMemFreeHost(self, p):
        return self._run("cuMemFreeHost", 0, lambda: self.platform.host_free(_int(p)))
