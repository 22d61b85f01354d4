"""The WDDM video-memory budget through DXGI, with ctypes (Windows 10 and later).

Under WDDM the video memory manager gives each process a *budget*: mapping
past it does not fail, it silently moves memory to shared system memory (the
GPU then runs from PCIe). ``IDXGIAdapter3::QueryVideoMemoryInfo`` with
``DXGI_MEMORY_SEGMENT_GROUP_LOCAL`` reports that budget and the process's
current usage (Microsoft docs: IDXGIAdapter3::QueryVideoMemoryInfo,
DXGI_QUERY_VIDEO_MEMORY_INFO). The adapter is found by the LUID the CUDA/HIP
driver reports for the device (``cuDeviceGetLuid``), through
``IDXGIFactory4::EnumAdapterByLuid``.

COM is called through the interfaces' vtables; the slot numbers follow the
declaration order in ``dxgi.h`` / ``dxgi1_2.h`` / ``dxgi1_4.h`` (IUnknown 3,
IDXGIObject 4, IDXGIFactory 5, IDXGIFactory1 2, IDXGIFactory2 11,
IDXGIFactory3 1, then IDXGIFactory4's EnumAdapterByLuid; IDXGIAdapter 3,
IDXGIAdapter1 1, IDXGIAdapter2 1, IDXGIAdapter3's QueryVideoMemoryInfo third).
Every failure is a :class:`~membackend.types.DriverError`; nothing here runs
off Windows.
"""

from __future__ import annotations

import ctypes
import sys
import uuid
from typing import NamedTuple

from ..types import DriverError

__all__ = ["VideoMemoryInfo", "query_video_memory", "luid_from_bytes"]

DXGI_MEMORY_SEGMENT_GROUP_LOCAL = 0
# vtable slots (see the module docstring)
_RELEASE = 2
_FACTORY4_ENUM_ADAPTER_BY_LUID = 26
_ADAPTER3_QUERY_VIDEO_MEMORY_INFO = 14
IID_IDXGIFactory4 = "1bc6ea02-ef36-464f-bf0c-21ca39e5168a"
IID_IDXGIAdapter3 = "645967a4-1392-4310-a798-8053ce3e93fd"


class VideoMemoryInfo(NamedTuple):
    """``DXGI_QUERY_VIDEO_MEMORY_INFO``: bytes, for the local (dedicated) segment group."""

    budget: int
    current_usage: int
    available_for_reservation: int
    current_reservation: int


class _LUID(ctypes.Structure):
    _fields_ = [("LowPart", ctypes.c_uint32), ("HighPart", ctypes.c_int32)]


class _GUID(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]

    @classmethod
    def of(cls, text: str) -> "_GUID":
        g = cls()
        ctypes.memmove(g.bytes, uuid.UUID(text).bytes_le, 16)  # GUIDs are stored little-endian
        return g


class _Info(ctypes.Structure):
    _fields_ = [("Budget", ctypes.c_uint64), ("CurrentUsage", ctypes.c_uint64),
                ("AvailableForReservation", ctypes.c_uint64), ("CurrentReservation", ctypes.c_uint64)]


def luid_from_bytes(raw: bytes) -> tuple[int, int]:
    """The 8 bytes of a LUID (as ``cuDeviceGetLuid`` fills them) → (LowPart, HighPart)."""
    if len(raw) < 8:
        raise DriverError("invalid", "cuDeviceGetLuid", f"a LUID has 8 bytes, got {len(raw)}")
    return int.from_bytes(raw[:4], "little"), int.from_bytes(raw[4:8], "little", signed=True)


def _method(obj: ctypes.c_void_p, slot: int, restype, *argtypes):
    vtable = ctypes.cast(obj, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)))[0]
    return ctypes.WINFUNCTYPE(restype, ctypes.c_void_p, *argtypes)(vtable[slot])  # type: ignore[attr-defined]


def _check(hr: int, call: str) -> None:
    if hr < 0:  # FAILED(hr)
        raise DriverError(f"HRESULT {hr & 0xFFFFFFFF:#010x}", call)


def _release(obj: ctypes.c_void_p) -> None:
    if obj:
        _method(obj, _RELEASE, ctypes.c_ulong)(obj)


def query_video_memory(luid: tuple[int, int], node: int = 0) -> VideoMemoryInfo:
    """Budget and usage of the local segment group of the adapter with ``luid`` (Windows only)."""
    if sys.platform != "win32":
        raise DriverError("unavailable", "IDXGIAdapter3::QueryVideoMemoryInfo", "DXGI exists only on Windows")
    try:
        dxgi = ctypes.WinDLL("dxgi")
    except OSError as exc:
        raise DriverError("unavailable", "CreateDXGIFactory1", str(exc)) from exc
    create = dxgi.CreateDXGIFactory1
    create.restype = ctypes.c_long
    create.argtypes = [ctypes.POINTER(_GUID), ctypes.POINTER(ctypes.c_void_p)]
    factory, adapter = ctypes.c_void_p(), ctypes.c_void_p()
    try:
        _check(create(ctypes.byref(_GUID.of(IID_IDXGIFactory4)), ctypes.byref(factory)), "CreateDXGIFactory1")
        by_luid = _method(factory, _FACTORY4_ENUM_ADAPTER_BY_LUID, ctypes.c_long,
                          _LUID, ctypes.POINTER(_GUID), ctypes.POINTER(ctypes.c_void_p))
        _check(by_luid(factory, _LUID(*luid), ctypes.byref(_GUID.of(IID_IDXGIAdapter3)), ctypes.byref(adapter)),
               "IDXGIFactory4::EnumAdapterByLuid")
        info = _Info()
        query = _method(adapter, _ADAPTER3_QUERY_VIDEO_MEMORY_INFO, ctypes.c_long,
                        ctypes.c_uint, ctypes.c_int, ctypes.POINTER(_Info))
        _check(query(adapter, node, DXGI_MEMORY_SEGMENT_GROUP_LOCAL, ctypes.byref(info)),
               "IDXGIAdapter3::QueryVideoMemoryInfo")
        return VideoMemoryInfo(info.Budget, info.CurrentUsage, info.AvailableForReservation, info.CurrentReservation)
    finally:
        _release(adapter)
        _release(factory)
