"""A ctypes binding of the HIP runtime library in hip-python's shape, for where hip-python does not install.

hip-python's dependencies (``rocm-bindings-hip``, ``rocm-bindings-core``) have
no Windows wheel, while torch's ROCm build for Windows carries the HIP runtime
(``amdhip64*.dll``) in ``torch/lib`` and comfy-aimdo calls that DLL directly.
:func:`load` opens the same library (see :func:`candidates` for the order) and
returns a :class:`HipRuntime`: the calls :class:`~membackend._drivers.hip.HipDriver`
makes, under hip-python's names and convention (the C inputs in C order;
returns ``(hipError_t, outputs...)``), plus the enums and structs it builds.

Constants and layouts follow ``hip_runtime_api.h`` / ``driver_types.h`` of HIP
7.1 (hip-python 10.0 carries the same values): every output is a leading
pointer argument; ``hipGetDeviceProperties`` is the ``hipDeviceProp_tR0600``
struct (``#define hipGetDeviceProperties hipGetDevicePropertiesR0600``, HIP 6
and later), 1472 bytes, of which :data:`PROPS_OFFSETS` are read. The test
suite checks both against hip-python's own definitions where it is installed.

Nothing is loaded at import. Every failure is a typed
:class:`~membackend.types.DriverError`.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..types import DriverError
from .gpu import host_address

__all__ = ["HipRuntime", "load", "candidates", "LIBRARY_ENV", "PROPS_OFFSETS", "PROPS_SIZE"]

#: an explicit path to the HIP runtime library, tried before anything else
LIBRARY_ENV = "MEMBACKEND_HIP_LIBRARY"

_c = ctypes
_VP, _SZ, _INT, _UINT, _ULL = _c.c_void_p, _c.c_size_t, _c.c_int, _c.c_uint, _c.c_ulonglong


class hipError_t(enum.IntEnum):  # noqa: N801 - HIP's names
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2
    hipErrorNotInitialized = 3
    hipErrorDeinitialized = 4
    hipErrorNoDevice = 100
    hipErrorInvalidDevice = 101
    hipErrorInvalidContext = 201
    hipErrorInvalidHandle = 400
    hipErrorNotReady = 600
    hipErrorIllegalAddress = 700
    hipErrorHostMemoryAlreadyRegistered = 712
    hipErrorHostMemoryNotRegistered = 713
    hipErrorNotSupported = 801
    hipErrorUnknown = 999


class hipDeviceAttribute_t(enum.IntEnum):  # noqa: N801 - only the ones membackend asks
    hipDeviceAttributeIntegrated = 16
    hipDeviceAttributePciBusId = 67
    hipDeviceAttributePciDeviceId = 68
    hipDeviceAttributePciDomainId = 69
    hipDeviceAttributeVirtualMemoryManagementSupported = 89


class hipMemAllocationType(enum.IntEnum):  # noqa: N801
    hipMemAllocationTypePinned = 0x1


class hipMemLocationType(enum.IntEnum):  # noqa: N801
    hipMemLocationTypeDevice = 1


class hipMemAccessFlags(enum.IntEnum):  # noqa: N801
    hipMemAccessFlagsProtReadWrite = 3


class hipMemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    hipMemAllocationGranularityMinimum = 0x0


hipEventDisableTiming = 0x2  # noqa: N816


class hipMemLocation(_c.Structure):  # noqa: N801
    _fields_ = [("type", _INT), ("id", _INT)]


class _AllocFlags(_c.Structure):
    _fields_ = [("compressionType", _c.c_ubyte), ("gpuDirectRDMACapable", _c.c_ubyte), ("usage", _c.c_ushort)]


class hipMemAllocationProp(_c.Structure):  # noqa: N801
    _fields_ = [("type", _INT), ("requestedHandleType", _INT), ("location", hipMemLocation),
                ("win32HandleMetaData", _VP), ("allocFlags", _AllocFlags)]


class hipMemAccessDesc(_c.Structure):  # noqa: N801
    _fields_ = [("location", hipMemLocation), ("flags", _INT)]


#: byte offsets of the fields read from hipDeviceProp_tR0600 (name and gcnArchName are char[256])
PROPS_OFFSETS = {"name": 0, "luid": 272, "luidDeviceNodeMask": 280, "totalGlobalMem": 288, "major": 360,
                 "minor": 364, "integrated": 396, "gcnArchName": 1160}
PROPS_SIZE = 1472


def _names() -> tuple[str, ...]:
    if sys.platform == "win32":
        return ("amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll")
    return ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")


def _torch_lib() -> Path | None:
    """``torch/lib`` of the installed torch, found without importing it."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def candidates() -> list[str]:
    """Where the HIP runtime is looked for, in order: ``MEMBACKEND_HIP_LIBRARY``; next to torch's
    ROCm build (``torch/lib``: any ``amdhip64*.dll`` / ``libamdhip64.so*``, so the process ends up
    with the one runtime torch loads later);
    ``HIP_PATH``/``ROCM_PATH`` (``bin`` on Windows, ``lib`` elsewhere); the library names alone,
    for the system's search path."""
    found: list[str] = []
    explicit = os.environ.get(LIBRARY_ENV, "").strip()
    if explicit:
        found.append(explicit)
    dirs = [_torch_lib()]
    for var in ("HIP_PATH", "ROCM_PATH"):
        root = os.environ.get(var, "").strip()
        if root:
            dirs.append(Path(root) / ("bin" if sys.platform == "win32" else "lib"))
    if sys.platform != "win32":
        dirs.append(Path("/opt/rocm/lib"))
    pattern = "amdhip64*.dll" if sys.platform == "win32" else "libamdhip64.so*"
    for folder in dirs:
        if folder is not None and folder.is_dir():  # any version's runtime, newest name first
            found += [str(p) for p in sorted(folder.glob(pattern), key=lambda p: p.name, reverse=True)]
    found += list(_names())
    return list(dict.fromkeys(found))


def load(path: str | None = None) -> "HipRuntime":
    """Open the HIP runtime (``path``, else the first of :func:`candidates` that loads).

    Raises ``DriverError("unavailable", "dlopen", ...)`` naming every place tried.
    """
    tried = []
    for candidate in [path] if path else candidates():
        try:
            if sys.platform == "win32" and os.path.isabs(candidate):
                os.add_dll_directory(os.path.dirname(candidate))  # its own dependencies sit beside it
            return HipRuntime(_c.CDLL(candidate), candidate)
        except OSError as exc:
            tried.append(f"{candidate} ({exc})" if os.path.isabs(candidate) else candidate)
    raise DriverError("unavailable", "dlopen", "no HIP runtime library found; tried " + ", ".join(tried)
                      + f" (set {LIBRARY_ENV} to its path)")


def _ptr(value: Any) -> int:
    """A pointer argument: an address, a handle with ``__int__``, or a host buffer as hip-python takes one."""
    return host_address(value)


class HipRuntime:
    """The HIP runtime library behind hip-python's call convention (see the module docstring).

    ``lib`` is anything whose attributes are C functions (a ``ctypes.CDLL``);
    each is called through a prototype declared here, so argument types do not
    depend on how ``lib`` was built. A missing symbol raises (the wrapper
    turns it into ``DriverError("unavailable", <call>)``).
    """

    hipError_t = hipError_t
    hipDeviceAttribute_t = hipDeviceAttribute_t
    hipMemAllocationType = hipMemAllocationType
    hipMemLocationType = hipMemLocationType
    hipMemAccessFlags = hipMemAccessFlags
    hipMemAllocationGranularity_flags = hipMemAllocationGranularity_flags
    hipMemAllocationProp = hipMemAllocationProp
    hipMemAccessDesc = hipMemAccessDesc
    hipEventDisableTiming = hipEventDisableTiming

    def __init__(self, lib: Any, path: str = "?"):
        self._lib = lib
        self.path = path
        self.label = f"HIP runtime via ctypes ({path})"
        self._fns: dict[str, Any] = {}

    def _fn(self, name: str, *argtypes: Any) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            address = _c.cast(getattr(self._lib, name), _VP).value
            if address is None:  # never for an exported symbol; the error CFUNCTYPE(...)(None) would raise
                raise TypeError(f"{name}: the library gives a null address")
            fn = self._fns[name] = _c.CFUNCTYPE(_INT, *argtypes)(address)
        return fn

    @staticmethod
    def _status(code: int) -> Any:
        try:
            return hipError_t(code)
        except ValueError:
            return int(code)

    def _out(self, name: str, out: Any, argtypes: tuple, *args: Any) -> tuple:
        """Call ``name(&out, *args)``; return ``(status, out.value)``."""
        status = self._fn(name, _c.POINTER(type(out)), *argtypes)(_c.byref(out), *args)
        return self._status(status), out.value

    def _plain(self, name: str, argtypes: tuple, *args: Any) -> tuple:
        return (self._status(self._fn(name, *argtypes)(*args)),)

    # devices
    def hipInit(self, flags):  # noqa: N802 - HIP's names
        return self._plain("hipInit", (_UINT,), flags)

    def hipGetDeviceCount(self):  # noqa: N802
        return self._out("hipGetDeviceCount", _INT(), ())

    def hipGetDevice(self):  # noqa: N802
        return self._out("hipGetDevice", _INT(), ())

    def hipSetDevice(self, deviceId):  # noqa: N802, N803
        return self._plain("hipSetDevice", (_INT,), deviceId)

    def hipDriverGetVersion(self):  # noqa: N802
        return self._out("hipDriverGetVersion", _INT(), ())

    def hipRuntimeGetVersion(self):  # noqa: N802
        return self._out("hipRuntimeGetVersion", _INT(), ())

    def hipDeviceGetName(self, len, device):  # noqa: N802, A002 - hip-python's parameter names
        buf = _c.create_string_buffer(len)
        status = self._fn("hipDeviceGetName", _c.c_char_p, _INT, _INT)(buf, len, device)
        return self._status(status), buf.value

    def hipDeviceTotalMem(self, device):  # noqa: N802
        return self._out("hipDeviceTotalMem", _SZ(), (_INT,), device)

    def hipDeviceGetAttribute(self, attr, deviceId):  # noqa: N802, N803
        return self._out("hipDeviceGetAttribute", _INT(), (_INT, _INT), int(attr), deviceId)

    def hipGetDeviceProperties(self, deviceId):  # noqa: N802, N803
        buf = (_c.c_ubyte * PROPS_SIZE)()
        status = self._status(self._fn("hipGetDevicePropertiesR0600", _VP, _INT)(_c.addressof(buf), deviceId))
        if status != hipError_t.hipSuccess:
            return status, None
        raw = bytes(buf)
        o = PROPS_OFFSETS

        def text(at: int) -> str:
            return raw[at:at + 256].split(b"\0")[0].decode(errors="replace")

        def num(at: int, size: int, signed: bool = False) -> int:
            return int.from_bytes(raw[at:at + size], sys.byteorder, signed=signed)

        return status, SimpleNamespace(
            name=text(o["name"]), gcnArchName=text(o["gcnArchName"]), totalGlobalMem=num(o["totalGlobalMem"], 8),
            integrated=num(o["integrated"], 4, True), major=num(o["major"], 4, True), minor=num(o["minor"], 4, True),
            luid=raw[o["luid"]:o["luid"] + 8], luidDeviceNodeMask=num(o["luidDeviceNodeMask"], 4))

    def hipDeviceSynchronize(self):  # noqa: N802
        return self._plain("hipDeviceSynchronize", ())

    def hipMemGetInfo(self):  # noqa: N802
        free, total = _SZ(), _SZ()
        status = self._fn("hipMemGetInfo", _c.POINTER(_SZ), _c.POINTER(_SZ))(_c.byref(free), _c.byref(total))
        return self._status(status), free.value, total.value

    # virtual memory
    def hipMemGetAllocationGranularity(self, prop, option):  # noqa: N802
        return self._out("hipMemGetAllocationGranularity", _SZ(), (_c.POINTER(hipMemAllocationProp), _INT),
                         _c.byref(prop), int(option))

    def hipMemAddressReserve(self, size, alignment, addr, flags):  # noqa: N802
        status, ptr = self._out("hipMemAddressReserve", _VP(), (_SZ, _SZ, _VP, _ULL), size, alignment,
                                _ptr(addr) or None, flags)
        return status, _ptr(ptr)

    def hipMemAddressFree(self, devPtr, size):  # noqa: N802, N803
        return self._plain("hipMemAddressFree", (_VP, _SZ), _ptr(devPtr), size)

    def hipMemCreate(self, size, prop, flags):  # noqa: N802
        status, handle = self._out("hipMemCreate", _VP(), (_SZ, _c.POINTER(hipMemAllocationProp), _ULL), size,
                                   _c.byref(prop), flags)
        return status, _ptr(handle)

    def hipMemRelease(self, handle):  # noqa: N802
        return self._plain("hipMemRelease", (_VP,), _ptr(handle))

    def hipMemMap(self, ptr, size, offset, handle, flags):  # noqa: N802
        return self._plain("hipMemMap", (_VP, _SZ, _SZ, _VP, _ULL), _ptr(ptr), size, offset, _ptr(handle), flags)

    def hipMemUnmap(self, ptr, size):  # noqa: N802
        return self._plain("hipMemUnmap", (_VP, _SZ), _ptr(ptr), size)

    def hipMemSetAccess(self, ptr, size, desc, count):  # noqa: N802
        descs = list(desc) if isinstance(desc, (list, tuple)) else [desc]
        array = (hipMemAccessDesc * len(descs))(*descs)
        return self._plain("hipMemSetAccess", (_VP, _SZ, _c.POINTER(hipMemAccessDesc), _SZ), _ptr(ptr), size,
                           array, count)

    # streams, events, copies, pinned host memory
    def hipStreamCreate(self):  # noqa: N802
        status, stream = self._out("hipStreamCreate", _VP(), ())
        return status, _ptr(stream)

    def hipStreamSynchronize(self, stream):  # noqa: N802
        return self._plain("hipStreamSynchronize", (_VP,), _ptr(stream))

    def hipEventCreateWithFlags(self, flags):  # noqa: N802
        status, event = self._out("hipEventCreateWithFlags", _VP(), (_UINT,), flags)
        return status, _ptr(event)

    def hipEventRecord(self, event, stream):  # noqa: N802
        return self._plain("hipEventRecord", (_VP, _VP), _ptr(event), _ptr(stream))

    def hipEventQuery(self, event):  # noqa: N802
        return self._plain("hipEventQuery", (_VP,), _ptr(event))

    def hipEventSynchronize(self, event):  # noqa: N802
        return self._plain("hipEventSynchronize", (_VP,), _ptr(event))

    def hipEventDestroy(self, event):  # noqa: N802
        return self._plain("hipEventDestroy", (_VP,), _ptr(event))

    def hipMemcpyHtoDAsync(self, dst, src, sizeBytes, stream):  # noqa: N802, N803
        return self._plain("hipMemcpyHtoDAsync", (_VP, _VP, _SZ, _VP), _ptr(dst), _ptr(src), sizeBytes, _ptr(stream))

    def hipMemcpyHtoD(self, dst, src, sizeBytes):  # noqa: N802, N803
        return self._plain("hipMemcpyHtoD", (_VP, _VP, _SZ), _ptr(dst), _ptr(src), sizeBytes)

    def hipMemcpyDtoH(self, dst, src, sizeBytes):  # noqa: N802, N803
        return self._plain("hipMemcpyDtoH", (_VP, _VP, _SZ), _ptr(dst), _ptr(src), sizeBytes)

    def hipHostMalloc(self, size, flags):  # noqa: N802
        status, ptr = self._out("hipHostMalloc", _VP(), (_SZ, _UINT), size, flags)
        return status, _ptr(ptr)

    def hipHostFree(self, ptr):  # noqa: N802
        return self._plain("hipHostFree", (_VP,), _ptr(ptr))

    def hipHostUnregister(self, hostPtr):  # noqa: N802, N803
        return self._plain("hipHostUnregister", (_VP,), _ptr(hostPtr))

    def hipGetLastError(self):  # noqa: N802
        return self._plain("hipGetLastError", ())
