"""A simulated ``hip.hip``: hip-python's function names, argument order, return tuples,
enums and structs (imported from hip-python), over a
:class:`~membackend._drivers.sim.platform.SimPlatform`.

Opaque handles (pointers, allocation handles, events, streams) come back as
plain ints: hip-python's handle types wrap runtime addresses, and every hip-python
call accepts an int where it takes one.

Where hip-python is not installed (Windows: its dependencies have no wheel) the
types come from :mod:`membackend._drivers.hip_ctypes`, whose enums and structs
carry the same names and values, so the simulation needs no HIP package.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from .api import SimApi, host_address
from .platform import SimError, SimPlatform

__all__ = ["SimHipModule"]


def _bindings() -> Any:
    try:
        from hip import hip
    except ImportError:
        from .. import hip_ctypes

        return hip_ctypes
    return hip


def _int(x: Any) -> int:
    return 0 if x is None else int(x)


def _address(x: Any) -> int:
    """A host pointer as the bindings take one: an int, a ctypes object or a writable buffer."""
    return host_address(x)


class SimHipModule(SimApi):
    success = "hipSuccess"
    status_enum = "hipError_t"
    kinds = {"oom": "hipErrorOutOfMemory", "invalid": "hipErrorInvalidValue",
             "invalid_device": "hipErrorInvalidDevice", "not_ready": "hipErrorNotReady",
             "invalid_context": "hipErrorInvalidContext", "not_supported": "hipErrorNotSupported",
             "no_device": "hipErrorNoDevice", "illegal_address": "hipErrorIllegalAddress",
             "already_registered": "hipErrorHostMemoryAlreadyRegistered",
             "not_registered": "hipErrorHostMemoryNotRegistered"}

    def __init__(self, platform: SimPlatform):
        self.types = _bindings()
        super().__init__(platform)
        # HIP runtime API reference, hipGetLastError: "returns the last error returned by any HIP runtime API
        # call (in this thread) and resets it to hipSuccess"
        self._last = threading.local()

    def _run(self, name: str, outputs: int, fn: Any) -> tuple:
        result = super()._run(name, outputs, fn)
        if result[0] != getattr(self._status, self.success):
            self._last.error = result[0]
        return result

    def hipGetLastError(self):
        error = getattr(self._last, "error", None)
        self._last.error = None
        return (error if error is not None else getattr(self._status, self.success),)

    def hipHostRegister(self, hostPtr, sizeBytes, flags):
        return self._run("hipHostRegister", 0, lambda: self.platform.host_register(_address(hostPtr), sizeBytes))

    def hipHostUnregister(self, hostPtr):
        return self._run("hipHostUnregister", 0, lambda: self.platform.host_unregister(_address(hostPtr)))

    def hipInit(self, flags):
        return self._run("hipInit", 0, self.platform.init)

    def hipGetDeviceCount(self):
        def count():
            if not self.platform.devices:  # "hipErrorNoDevice: Call to hipGetDeviceCount returned 0 devices"
                raise SimError("no_device", "no HIP device is visible")
            return len(self.platform.devices)
        return self._run("hipGetDeviceCount", 1, count)

    def hipDriverGetVersion(self):
        return self._run("hipDriverGetVersion", 1, lambda: self.platform.profile.driver_version)

    def hipRuntimeGetVersion(self):
        return self._run("hipRuntimeGetVersion", 1, lambda: self.platform.profile.driver_version)

    def hipSetDevice(self, deviceId):
        return self._run("hipSetDevice", 0, lambda: self.platform.set_current(deviceId))

    def hipGetDevice(self):
        return self._run("hipGetDevice", 1, lambda: self.platform.current)

    def hipDeviceTotalMem(self, device):
        return self._run("hipDeviceTotalMem", 1, lambda: self.platform._device(device).vram)

    def hipDeviceGetName(self, len, device):  # noqa: A002 - hip-python's parameter name
        return self._run("hipDeviceGetName", 1, lambda: self.platform._device(device).name.encode()[:len])

    def hipDeviceGetAttribute(self, attr, deviceId):
        a = self.types.hipDeviceAttribute_t

        def get():
            d = self.platform._device(deviceId)
            domain, bus, dev = self.platform.pci_location(deviceId)
            return {a.hipDeviceAttributeIntegrated: int(d.integrated),
                    a.hipDeviceAttributeVirtualMemoryManagementSupported: int(d.vmm),
                    a.hipDeviceAttributePciDomainId: domain, a.hipDeviceAttributePciBusId: bus,
                    a.hipDeviceAttributePciDeviceId: dev}.get(attr, 0)
        return self._run("hipDeviceGetAttribute", 1, get)

    def hipGetDeviceProperties(self, deviceId):
        def props():
            # hip-python's hipDeviceProp_t has read-only char fields, so the sim answers with a
            # record carrying the same attribute names
            d = self.platform._device(deviceId)
            windows = self.platform.profile.os == "windows"  # the LUID fields are zero elsewhere
            digits = d.arch[3:] if d.arch.startswith("gfx") else ""  # gfx1201: 12.0, gfx908: 9.0
            major, minor = (int(digits[:-2]), int(digits[-2], 16)) if len(digits) >= 3 else (0, 0)
            return SimpleNamespace(name=d.name, gcnArchName=f"{d.arch}:sramecc+:xnack-", totalGlobalMem=d.vram,
                                   integrated=int(d.integrated), major=major, minor=minor,
                                   luid=self.platform.luid(d.index) if windows else bytes(8),
                                   luidDeviceNodeMask=1 if windows else 0)
        return self._run("hipGetDeviceProperties", 1, props)

    def hipDeviceSynchronize(self):
        return self._run("hipDeviceSynchronize", 0, self.platform.device_synchronize)

    def hipMemGetInfo(self):
        return self._run("hipMemGetInfo", 2, self.platform.mem_get_info)

    def hipMemGetAllocationGranularity(self, prop, option):
        return self._run("hipMemGetAllocationGranularity", 1, lambda: self.platform.profile.granularity)

    def hipMemAddressReserve(self, size, alignment, addr, flags):
        # no range left: hipErrorOutOfMemory, as ROCm clr's hip_vm.cpp answers it (SimPlatform.address_reserve)
        return self._run("hipMemAddressReserve", 1, lambda: self.platform.address_reserve(size, alignment))

    def hipMemAddressFree(self, devPtr, size):
        return self._run("hipMemAddressFree", 0, lambda: self.platform.address_free(_int(devPtr), size))

    def hipMemCreate(self, size, prop, flags):
        return self._run("hipMemCreate", 1, lambda: self.platform.create(size, int(prop.location.id)))

    def hipMemRelease(self, handle):
        return self._run("hipMemRelease", 0, lambda: self.platform.release(_int(handle)))

    def hipMemMap(self, ptr, size, offset, handle, flags):
        return self._run("hipMemMap", 0, lambda: self.platform.map(_int(ptr), size, offset, _int(handle)))

    def hipMemUnmap(self, ptr, size):
        return self._run("hipMemUnmap", 0, lambda: self.platform.unmap(_int(ptr), size))

    def hipMemSetAccess(self, ptr, size, desc, count):
        first = desc[0] if isinstance(desc, (list, tuple)) else desc
        return self._run("hipMemSetAccess", 0, lambda: self.platform.set_access(_int(ptr), size,
                                                                                 int(first.location.id)))

    def hipStreamCreate(self):
        return self._run("hipStreamCreate", 1, self.platform.stream_create)

    def hipStreamSynchronize(self, stream):
        return self._run("hipStreamSynchronize", 0, lambda: self.platform.stream_synchronize(_int(stream)))

    def hipEventCreateWithFlags(self, flags):
        return self._run("hipEventCreateWithFlags", 1, self.platform.event_create)

    def hipEventRecord(self, event, stream):
        return self._run("hipEventRecord", 0, lambda: self.platform.event_record(_int(event), _int(stream)))

    def hipEventQuery(self, event):
        def query():
            if not self.platform.event_query(_int(event)):
                raise SimError("not_ready", "work before the event is still running")
        return self._run("hipEventQuery", 0, query)

    def hipEventSynchronize(self, event):
        return self._run("hipEventSynchronize", 0, lambda: self.platform.event_synchronize(_int(event)))

    def hipEventDestroy(self, event):
        return self._run("hipEventDestroy", 0, lambda: self.platform.event_destroy(_int(event)))

    def hipMemcpyHtoDAsync(self, dst, src, sizeBytes, stream):
        return self._run("hipMemcpyHtoDAsync", 0,
                         lambda: self.platform.copy_async(_int(dst), sizeBytes, _int(stream), _address(src)))

    def hipMemcpyHtoD(self, dst, src, sizeBytes):
        return self._run("hipMemcpyHtoD", 0,
                         lambda: self.platform.copy_sync(_int(dst), _address(src), sizeBytes, to_device=True))

    def hipMemcpyDtoH(self, dst, src, sizeBytes):
        return self._run("hipMemcpyDtoH", 0,
                         lambda: self.platform.copy_sync(_address(dst), _int(src), sizeBytes, to_device=False))

    def hipHostMalloc(self, size, flags):
        return self._run("hipHostMalloc", 1, lambda: self.platform.pinned_alloc(size))

    def hipHostFree(self, ptr):
        return self._run("hipHostFree", 0, lambda: self.platform.pinned_free(_int(ptr)))
