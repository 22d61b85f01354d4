"""A simulated ``cuda.bindings.driver``: the same function names, argument order, return
tuples, enums and structs as cuda-python, over a
:class:`~membackend._drivers.sim.platform.SimPlatform`.

The types (status codes, handles, enums, structs) are cuda-python's where it is installed.
Without it (``pip install membackend`` with no extra) they come from :data:`STAND_IN_TYPES`
below, which carries the same names and values for every type the simulation and
:class:`~membackend._drivers.cuda.CudaDriver` use, so a replay needs no CUDA package; the
test suite checks each of them against cuda-python's own where that is installed.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

from .api import SimApi, host_address
from .platform import SimError, SimPlatform

__all__ = ["SimCudaDriverModule", "STAND_IN_TYPES"]


# --------------------------------------------------------------------------- stand-in types
# Names and values are those of the CUDA driver API header (cuda.h, CUDA 13.0), as cuda-python's
# ``cuda.bindings.driver`` (13.x) exposes them; only the members membackend uses are listed.


class CUresult(enum.IntEnum):  # cuda.h: enum cudaError_enum (a subset)
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_MAP_FAILED = 205
    CUDA_ERROR_UNMAP_FAILED = 206
    CUDA_ERROR_ALREADY_MAPPED = 208
    CUDA_ERROR_NOT_MAPPED = 211
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


class CUdevice_attribute(enum.IntEnum):  # noqa: N801 - cuda.h: enum CUdevice_attribute_enum (a subset)
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
    CU_DEVICE_ATTRIBUTE_TCC_DRIVER = 35
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CUmemAllocationType(enum.IntEnum):  # cuda.h: enum CUmemAllocationType_enum
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):  # cuda.h: enum CUmemLocationType_enum
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801 - cuda.h: CUmemAllocationGranularity_flags_enum
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - cuda.h: enum CUmemAccess_flags_enum
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUevent_flags(enum.IntEnum):  # noqa: N801 - cuda.h: enum CUevent_flags_enum
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2


class _Handle:
    """An opaque driver value as cuda-python's are: built from an int, ``int()`` gives it back;
    two are equal only when they are the same object (cuda-python's ``CUdevice``, ``CUdeviceptr``,
    ``CUmemGenericAllocationHandle``)."""

    __slots__ = ("_value",)

    def __init__(self, init_value: Any = 0):
        self._value = int(init_value or 0)

    def __int__(self) -> int:
        return self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value}>"


class _Pointer(_Handle):
    """A handle that wraps a driver pointer (cuda-python's ``CUcontext``, ``CUstream``, ``CUevent``):
    equal when it points at the same object, shown in hex."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and int(other) == self._value

    __hash__ = _Handle.__hash__

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdevice(_Handle):
    __slots__ = ()


class CUcontext(_Pointer):
    __slots__ = ()


class CUdeviceptr(_Handle):
    __slots__ = ()


class CUmemGenericAllocationHandle(_Handle):
    __slots__ = ()


class CUstream(_Pointer):
    __slots__ = ()


class CUevent(_Pointer):
    __slots__ = ()


class CUmemLocation:
    """cuda.h: struct CUmemLocation_st (``type``, ``id``)."""

    def __init__(self) -> None:
        self.type, self.id = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID, 0


class CUmemAllocationProp:
    """cuda.h: struct CUmemAllocationProp_st (the fields membackend sets)."""

    def __init__(self) -> None:
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.requestedHandleTypes = 0
        self.location = CUmemLocation()


class CUmemAccessDesc:
    """cuda.h: struct CUmemAccessDesc_st (``location``, ``flags``)."""

    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


#: the types the simulation answers with where cuda-python is not installed
STAND_IN_TYPES = SimpleNamespace(**{t.__name__: t for t in (
    CUresult, CUdevice_attribute, CUmemAllocationType, CUmemLocationType, CUmemAllocationGranularity_flags,
    CUmemAccess_flags, CUevent_flags, CUdevice, CUcontext, CUdeviceptr, CUmemGenericAllocationHandle, CUstream,
    CUevent, CUmemLocation, CUmemAllocationProp, CUmemAccessDesc)})


def _bindings() -> Any:
    """cuda-python's driver module where it imports (12.6 and later, then the older ``cuda.cuda``),
    else :data:`STAND_IN_TYPES`."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6
        except ImportError:
            return STAND_IN_TYPES
    return driver


def _int(x: Any) -> int:
    return 0 if x is None else int(x)


class SimCudaDriverModule(SimApi):
    success = "CUDA_SUCCESS"
    status_enum = "CUresult"
    kinds = {"oom": "CUDA_ERROR_OUT_OF_MEMORY", "invalid": "CUDA_ERROR_INVALID_VALUE",
             "invalid_device": "CUDA_ERROR_INVALID_DEVICE", "not_ready": "CUDA_ERROR_NOT_READY",
             "invalid_context": "CUDA_ERROR_INVALID_CONTEXT", "not_supported": "CUDA_ERROR_NOT_SUPPORTED",
             "no_device": "CUDA_ERROR_NO_DEVICE", "illegal_address": "CUDA_ERROR_ILLEGAL_ADDRESS",
             "already_registered": "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
             "not_registered": "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"}

    def __init__(self, platform: SimPlatform):
        self.types = _bindings()
        super().__init__(platform)

    def _ctx(self, name: str, outputs: int, fn: Any) -> tuple:
        """A call whose documented errors include CUDA_ERROR_INVALID_CONTEXT: it needs a bound context
        (cuda-python's docstrings list the codes each call returns)."""
        def run():
            self.platform.require_context()
            return fn()
        return self._run(name, outputs, run)

    # devices and contexts
    def cuInit(self, Flags):
        def init():
            self.platform.init()
            if not self.platform.devices:  # nothing visible (cuInit's CUDA_ERROR_NO_DEVICE)
                raise SimError("no_device", "no CUDA-capable device is visible")
        return self._run("cuInit", 0, init)

    def cuDriverGetVersion(self):
        return self._run("cuDriverGetVersion", 1, lambda: self.platform.profile.driver_version)

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
            p = self.platform
            d = p._device(_int(dev))
            major, minor = (int(d.arch[3:-1] or 0), int(d.arch[-1])) if d.arch.startswith("sm_") else (0, 0)
            domain, bus, slot = p.pci_location(d.index)
            # TCC_DRIVER is 1 for TCC (and MCDM) devices, 0 under WDDM and on every other OS
            return {a.CU_DEVICE_ATTRIBUTE_INTEGRATED: int(d.integrated),
                    a.CU_DEVICE_ATTRIBUTE_TCC_DRIVER: int(not p.profile.wddm and p.profile.os == "windows"),
                    a.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: int(d.vmm),
                    a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: major,
                    a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: minor,
                    a.CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: domain,
                    a.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: bus,
                    a.CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: slot}.get(attrib, 0)
        return self._run("cuDeviceGetAttribute", 1, get)

    def cuDeviceGetLuid(self, dev):
        def luid():
            if self.platform.profile.os != "windows":  # "only meaningful on Windows"
                raise SimError("not_supported", "a device LUID exists on Windows only")
            return self.platform.luid(_int(dev)), 1  # (8 bytes, node mask)
        return self._run("cuDeviceGetLuid", 2, luid)

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._run("cuDevicePrimaryCtxRetain", 1,
                         lambda: self.types.CUcontext(self.platform.primary_retain(_int(dev))))

    def cuDevicePrimaryCtxRelease(self, dev):
        return self._run("cuDevicePrimaryCtxRelease", 0, lambda: self.platform.primary_release(_int(dev)))

    def cuCtxGetCurrent(self):
        return self._run("cuCtxGetCurrent", 1, lambda: self.types.CUcontext(self.platform.current_context))

    def cuCtxSetCurrent(self, ctx):
        return self._run("cuCtxSetCurrent", 0, lambda: self.platform.set_current_context(_int(ctx)))

    def cuCtxGetDevice(self):
        return self._ctx("cuCtxGetDevice", 1, lambda: self.types.CUdevice(self.platform.current))

    def cuCtxSynchronize(self):
        return self._ctx("cuCtxSynchronize", 0, self.platform.device_synchronize)

    def cuMemGetInfo(self):
        return self._ctx("cuMemGetInfo", 2, self.platform.mem_get_info)

    # virtual memory management
    def cuMemGetAllocationGranularity(self, prop, option):
        return self._run("cuMemGetAllocationGranularity", 1, lambda: self.platform.profile.granularity)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        # no range left: CUDA_ERROR_OUT_OF_MEMORY, as cuda.h documents it (SimPlatform.address_reserve)
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
        return self._ctx("cuStreamCreate", 1, lambda: self.types.CUstream(self.platform.stream_create()))

    def cuStreamSynchronize(self, hStream):
        return self._ctx("cuStreamSynchronize", 0, lambda: self.platform.stream_synchronize(_int(hStream)))

    def cuEventCreate(self, Flags):
        return self._ctx("cuEventCreate", 1, lambda: self.types.CUevent(self.platform.event_create()))

    def cuEventRecord(self, hEvent, hStream):
        return self._ctx("cuEventRecord", 0, lambda: self.platform.event_record(_int(hEvent), _int(hStream)))

    def cuEventQuery(self, hEvent):
        def query():
            if not self.platform.event_query(_int(hEvent)):
                raise SimError("not_ready", "work before the event is still running")
        return self._run("cuEventQuery", 0, query)

    def cuEventSynchronize(self, hEvent):
        return self._ctx("cuEventSynchronize", 0, lambda: self.platform.event_synchronize(_int(hEvent)))

    def cuEventDestroy(self, hEvent):
        return self._ctx("cuEventDestroy", 0, lambda: self.platform.event_destroy(_int(hEvent)))

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream):
        return self._ctx("cuMemcpyHtoDAsync", 0, lambda: self.platform.copy_async(
            _int(dstDevice), ByteCount, _int(hStream), host_address(srcHost)))

    def cuMemcpyHtoD(self, dstDevice, srcHost, ByteCount):
        return self._ctx("cuMemcpyHtoD", 0, lambda: self.platform.copy_sync(
            _int(dstDevice), host_address(srcHost), ByteCount, to_device=True))

    def cuMemcpyDtoH(self, dstHost, srcDevice, ByteCount):
        return self._ctx("cuMemcpyDtoH", 0, lambda: self.platform.copy_sync(
            host_address(dstHost), _int(srcDevice), ByteCount, to_device=False))

    def cuMemAllocHost(self, bytesize):
        return self._ctx("cuMemAllocHost", 1, lambda: self.platform.pinned_alloc(bytesize))

    def cuMemFreeHost(self, p):
        return self._ctx("cuMemFreeHost", 0, lambda: self.platform.pinned_free(_int(p)))

    def cuMemHostRegister(self, p, bytesize, Flags):
        return self._ctx("cuMemHostRegister", 0, lambda: self.platform.host_register(host_address(p), bytesize))

    def cuMemHostUnregister(self, p):
        return self._ctx("cuMemHostUnregister", 0, lambda: self.platform.host_unregister(host_address(p)))
