"""HIP driver wrapper over hip-python's ``hip.hip`` (or a simulation of it).

The same virtual memory calls as CUDA under HIP's names (``hipMemAddressReserve``,
``hipMemCreate``, ``hipMemMap``, ``hipMemSetAccess``, ``hipMemUnmap``,
``hipMemRelease``, ``hipMemAddressFree``). The current device is set with
``hipSetDevice`` before every call that touches one: on Windows with two
devices visible, a free issued on the wrong device fails (TheRock #6224).
"""

from __future__ import annotations

from typing import Any

from .gpu import GpuDriver

__all__ = ["HipDriver"]


def _import_hip() -> Any:
    from hip import hip  # the `hip` extra

    return hip


class HipDriver(GpuDriver):
    vendor = "hip"

    def __init__(self, module: Any = None, label: str | None = None):
        module = module if module is not None else _import_hip()
        super().__init__(module, label or getattr(module, "label", "hip-python"))
        e = self.m.hipError_t
        self.SUCCESS, self.OOM, self.NOT_READY = e.hipSuccess, e.hipErrorOutOfMemory, e.hipErrorNotReady
        self._props: dict[int, Any] = {}

    def init(self) -> None:
        self.call("hipInit", 0)

    def device_count(self) -> int:
        return int(self.call("hipGetDeviceCount")[0])

    def set_device(self, index: int) -> None:
        self.call("hipSetDevice", index)

    def current_device(self) -> int:
        return int(self.call("hipGetDevice")[0])

    def total_mem(self, index: int) -> int:
        return int(self.call("hipDeviceTotalMem", index)[0])

    def name(self, index: int) -> str:
        raw = self.call("hipDeviceGetName", 256, index)[0]
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\0")[0]

    def integrated(self, index: int) -> bool:
        attr = self.m.hipDeviceAttribute_t.hipDeviceAttributeIntegrated
        return bool(self.call("hipDeviceGetAttribute", attr, index)[0])

    def arch(self, index: int) -> str:
        props = self.call("hipGetDeviceProperties", index)[0]
        raw = props.gcnArchName
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split(":")[0].split("\0")[0]

    def driver_model(self, index: int, os_name: str | None = None) -> str | None:
        return None  # WDDM/TCC is an NVIDIA notion

    def _prop(self, index: int) -> Any:
        prop = self._props.get(index)
        if prop is None:
            h = self.m
            prop = h.hipMemAllocationProp()
            prop.type = h.hipMemAllocationType.hipMemAllocationTypePinned
            prop.location.type = h.hipMemLocationType.hipMemLocationTypeDevice
            prop.location.id = index
            self._props[index] = prop
        return prop

    def granularity(self, index: int) -> int:
        option = self.m.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum
        return int(self.call("hipMemGetAllocationGranularity", self._prop(index), option)[0])

    def address_reserve(self, size: int, alignment: int) -> int:
        return int(self.call("hipMemAddressReserve", size, alignment, None, 0)[0])

    def address_free(self, ptr: int, size: int) -> None:
        self.call("hipMemAddressFree", ptr, size)

    def create(self, size: int, index: int) -> Any:
        return self.call("hipMemCreate", size, self._prop(index), 0)[0]

    def release(self, handle: Any) -> None:
        self.call("hipMemRelease", handle)

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self.call("hipMemMap", ptr, size, 0, handle, 0)

    def unmap(self, ptr: int, size: int) -> None:
        self.call("hipMemUnmap", ptr, size)

    def set_access(self, ptr: int, size: int, index: int) -> None:
        h = self.m
        desc = h.hipMemAccessDesc()
        desc.location.type = h.hipMemLocationType.hipMemLocationTypeDevice
        desc.location.id = index
        desc.flags = h.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        self.call("hipMemSetAccess", ptr, size, desc, 1)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.call("hipMemGetInfo")
        return int(free), int(total)

    def event_create(self) -> Any:
        return self.call("hipEventCreateWithFlags", self.m.hipEventDisableTiming)[0]

    def event_record(self, event: Any, stream: Any) -> None:
        self.call("hipEventRecord", event, stream)

    def event_query(self, event: Any) -> bool:
        return self._query("hipEventQuery", event)

    def event_synchronize(self, event: Any) -> None:
        self.call("hipEventSynchronize", event)

    def event_destroy(self, event: Any) -> None:
        self.call("hipEventDestroy", event)

    def stream_create(self) -> Any:
        return self.call("hipStreamCreate")[0]

    def stream_synchronize(self, stream: Any) -> None:
        self.call("hipStreamSynchronize", stream)

    def device_synchronize(self) -> None:
        self.call("hipDeviceSynchronize")

    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Any) -> None:
        self.call("hipMemcpyHtoDAsync", dst, src, size, stream)
