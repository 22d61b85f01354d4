"""HIP driver wrapper over hip-python's ``hip.hip``, the ctypes binding in
:mod:`membackend._drivers.hip_ctypes`, or a simulation of either.

The same virtual memory calls as CUDA under HIP's names (``hipMemAddressReserve``,
``hipMemCreate``, ``hipMemMap``, ``hipMemSetAccess``, ``hipMemUnmap``,
``hipMemRelease``, ``hipMemAddressFree``). Every call that touches a device runs
with the selected device current (``hipSetDevice``) and the caller's device
current again afterwards (``hipGetDevice`` first): on Windows with two devices
visible, a free issued on the wrong device fails (TheRock #6224), and the
thread's device is what torch's ``current_device()`` reads.

Discovery reads ``hipGetDeviceProperties`` (name, total memory, ``gcnArchName``,
``integrated``, LUID) and ``hipDeviceGetAttribute`` (integrated, virtual memory
management support) after ``hipInit``; the runtime lists only the devices
``HIP_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` leave visible.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..types import DriverError
from .gpu import GpuDriver

__all__ = ["HipDriver"]


def _import_hip() -> Any:
    from hip import hip  # the `hip` extra (Linux)

    return hip


def _text(raw: Any) -> str:
    return (raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)).split("\0")[0]


class HipDriver(GpuDriver):
    vendor = "hip"

    def __init__(self, module: Any = None, label: str | None = None):
        real = module is None
        module = _import_hip() if real else module
        if real and label is None:
            try:
                import importlib.metadata

                label = f"hip-python {importlib.metadata.version('hip-python')}"
            except Exception:
                label = "hip-python"
        if not label:
            label = getattr(module, "label", "hip")
        super().__init__(module, label)
        e = self.m.hipError_t
        self.SUCCESS, self.OOM, self.NOT_READY = e.hipSuccess, e.hipErrorOutOfMemory, e.hipErrorNotReady
        self._props: dict[int, Any] = {}

    def init(self) -> None:
        self.call("hipInit", 0)

    def device_count(self) -> int:
        return int(self.call("hipGetDeviceCount")[0])

    def driver_version(self) -> int:
        return int(self.call("hipDriverGetVersion")[0])

    # ------------------------------------------------------------------ the current device

    def current_device(self) -> int:
        """The calling thread's current device (``hipGetDevice``; 0 until a thread sets one)."""
        return int(self.call("hipGetDevice")[0])

    def _switch_to(self, index: int | None) -> Any:
        if index is None:
            return None  # a HIP thread always has a device (0 by default): the caller's serves
        current = int(self.call("hipGetDevice")[0])
        if current == index:
            return None
        self.call("hipSetDevice", index)
        return current

    def _restore(self, saved: Any) -> None:
        self.call("hipSetDevice", saved)

    # ------------------------------------------------------------------ discovery

    def properties(self, index: int) -> SimpleNamespace:
        """``hipGetDeviceProperties``: name, total_memory, arch (``gcnArchName`` up to the first
        ``:``), integrated, luid (8 bytes) and luid_node_mask of device ``index``."""
        p = self.call("hipGetDeviceProperties", index)[0]
        return SimpleNamespace(name=_text(p.name), total_memory=int(p.totalGlobalMem),
                               arch=_text(p.gcnArchName).split(":")[0] or None, integrated=bool(p.integrated),
                               luid=bytes(getattr(p, "luid", b"") or b""),
                               luid_node_mask=int(getattr(p, "luidDeviceNodeMask", 0) or 0))

    def total_mem(self, index: int) -> int:
        return int(self.call("hipDeviceTotalMem", index)[0])

    def name(self, index: int) -> str:
        return _text(self.call("hipDeviceGetName", 256, index)[0])

    def attribute(self, index: int, attribute: Any) -> int:
        """``hipDeviceGetAttribute``; ``attribute`` is a ``hipDeviceAttribute_t`` or its name without
        the ``hipDeviceAttribute`` prefix."""
        if isinstance(attribute, str):
            attribute = getattr(self.m.hipDeviceAttribute_t, f"hipDeviceAttribute{attribute}")
        return int(self.call("hipDeviceGetAttribute", attribute, index)[0])

    def integrated(self, index: int) -> bool:
        return bool(self.attribute(index, "Integrated"))

    def vmm_supported(self, index: int) -> bool:
        """hipDeviceAttributeVirtualMemoryManagementSupported (0 on e.g. an MI100 under ROCm 5.4, ROCm/hip #3151)."""
        return bool(self.attribute(index, "VirtualMemoryManagementSupported"))

    def arch(self, index: int) -> str:
        return self.properties(index).arch or ""

    def driver_model(self, index: int, os_name: str | None = None) -> str | None:
        return None  # WDDM/TCC is an NVIDIA notion

    def pci_location(self, index: int) -> tuple[int, int, int] | None:
        """(domain, bus, device) from ``hipDeviceGetAttribute`` (PciDomainId, PciBusId, PciDeviceId): where the
        amdgpu driver's sysfs files of the device are; None when the runtime does not answer them. (Older HIP
        headers spell the first ``PciDomainID``: either is asked for.)"""
        try:
            try:
                domain = self.attribute(index, "PciDomainId")
            except AttributeError:
                domain = self.attribute(index, "PciDomainID")
            return domain, self.attribute(index, "PciBusId"), self.attribute(index, "PciDeviceId")
        except (DriverError, AttributeError):
            return None

    def luid(self, index: int) -> tuple[int, int]:
        """The adapter LUID from ``hipDeviceProp_t.luid`` (Windows; hip-python has no ``hipDeviceGetLuid``)."""
        from .dxgi import luid_from_bytes

        return luid_from_bytes(self.properties(index).luid)

    # ------------------------------------------------------------------ virtual memory

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
        return int(self._on("hipMemGetAllocationGranularity", self._prop(index), option)[0])

    def address_reserve(self, size: int, alignment: int) -> int:
        return int(self._on("hipMemAddressReserve", size, alignment, None, 0)[0])

    def address_free(self, ptr: int, size: int) -> None:
        self._on("hipMemAddressFree", ptr, size)

    def create(self, size: int, index: int) -> Any:
        return self._on("hipMemCreate", size, self._prop(index), 0)[0]

    def release(self, handle: Any) -> None:
        self._on("hipMemRelease", handle)

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self._on("hipMemMap", ptr, size, 0, handle, 0)

    def unmap(self, ptr: int, size: int) -> None:
        self._on("hipMemUnmap", ptr, size)

    def set_access(self, ptr: int, size: int, index: int) -> None:
        h = self.m
        desc = h.hipMemAccessDesc()
        desc.location.type = h.hipMemLocationType.hipMemLocationTypeDevice
        desc.location.id = index
        desc.flags = h.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        self._on("hipMemSetAccess", ptr, size, desc, 1)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._on("hipMemGetInfo")
        return int(free), int(total)

    # ------------------------------------------------------------------ streams, events, copies

    def event_create(self) -> Any:
        return self._on("hipEventCreateWithFlags", self.m.hipEventDisableTiming)[0]

    def event_record(self, event: Any, stream: Any) -> None:
        self._on("hipEventRecord", event, stream)

    def event_query(self, event: Any) -> bool:
        return self._query("hipEventQuery", event)

    def event_synchronize(self, event: Any) -> None:
        self.call("hipEventSynchronize", event)

    def event_destroy(self, event: Any) -> None:
        self.call("hipEventDestroy", event)

    def stream_create(self) -> Any:
        return self._on("hipStreamCreate")[0]

    def stream_synchronize(self, stream: Any) -> None:
        self._on("hipStreamSynchronize", stream)

    def device_synchronize(self) -> None:
        self._on("hipDeviceSynchronize")

    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Any) -> None:
        self._on("hipMemcpyHtoDAsync", dst, src, size, stream)

    def memcpy_htod(self, dst: int, src: Any, size: int) -> None:
        """Synchronous host-to-device copy (after the work queued before it)."""
        self._on("hipMemcpyHtoD", dst, src, size)

    def memcpy_dtoh(self, dst: Any, src: int, size: int) -> None:
        """Synchronous device-to-host copy (after the work queued before it)."""
        self._on("hipMemcpyDtoH", dst, src, size)

    def host_unregister(self, ptr: int) -> bool:
        """``hipHostUnregister`` of the range page-locked at ``ptr`` (``hipHostRegister``, which torch's ROCm
        build calls for ``cudaHostRegister``): True when one started there, False when none did
        (``hipErrorHostMemoryNotRegistered``). HIP has no driver API beside the runtime, so a refusal is
        also taken off the thread's last error (``hipGetLastError``), which torch reads after its launches."""
        try:
            self._on("hipHostUnregister", ptr)
        except DriverError as exc:
            try:
                self.call("hipGetLastError")  # returns and clears the error the refusal left
            except DriverError:
                pass  # it answers that same error as its status
            if exc.code == self.m.hipError_t.hipErrorHostMemoryNotRegistered:
                return False
            raise
        return True
