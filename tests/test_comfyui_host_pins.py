"""ComfyUI's pinned host memory never outlives its registration (issue 34: the "invalid argument" and the
image that differed after ``/free`` and under a cap on the H200).

ComfyUI cuts each pin at the start of an extension of a ``HostBuffer`` and page-locks it itself
(``cudaHostRegister``, ``comfy/pinned_memory.py``); it leaves the unlocking to the buffer's ``truncate(size,
do_unregister=True)`` and to the buffer's end, as comfy-aimdo's buffer does (``src/hostbuf.c``). membackend's
stand-in buffer did neither: a dropped model's buffer was unmapped with its pins still registered, and later
mappings at those addresses were copied from the old, locked pages, or refused ("CUDA error: invalid
argument" from ``read_file_to_device``). Here on the simulated H200, whose driver keeps the registrations'
books as CUDA's does, ComfyUI's ``cudaHostRegister`` is the driver call it makes (``cuMemHostRegister``).
"""

from __future__ import annotations

import ctypes
import gc

import pytest

from membackend._comfyui import runtime as adapter
from membackend._comfyui.buffers import HostBuffer
from membackend._drivers.hip import HipDriver
from membackend._drivers.sim.hip import SimHipModule
from membackend._drivers.sim.platform import SimPlatform
from membackend._drivers.sim.profiles import PROFILES

MiB = 1 << 20


@pytest.fixture
def rt(h200_adapter):
    """A started adapter on the simulated H200 (its reaper thread running), no ComfyUI patches."""
    return h200_adapter


def _driver(rt):
    return rt.session.backend.driver


def _pin(rt, hostbuf: HostBuffer, size: int) -> int:
    """What ``comfy.pinned_memory.pin_memory`` does: extend, cut the pin at the extension's start, lock it."""
    start = hostbuf.extend(size, register=False)
    driver = _driver(rt)
    with driver.on_device(0):  # torch's context is current on ComfyUI's thread
        status = driver.m.cuMemHostRegister(start, size, 1)[0]
    assert status == driver.SUCCESS, status
    return start


def _registered(rt) -> dict[int, int]:
    return dict(_driver(rt).m.platform.host_registered)


def test_truncate_ends_the_registrations_it_cuts_off_and_keeps_the_rest(rt):
    hb = HostBuffer(0, 8 * MiB, 64 * MiB)
    a, b, c = (_pin(rt, hb, 4 * MiB) for _ in range(3))
    assert set(_registered(rt)) == {a, b, c}
    hb.truncate(b - hb.get_raw_address(), do_unregister=True)  # ComfyUI's partially_unload_ram pops b and c
    assert set(_registered(rt)) == {a}
    # the same addresses are pinned again as ComfyUI extends anew: the driver accepts them
    b2 = _pin(rt, hb, 4 * MiB)
    assert b2 == b and set(_registered(rt)) == {a, b}
    hb.close()


def test_truncate_without_unregister_leaves_the_driver_alone(rt):
    hb = HostBuffer(0, 8 * MiB, 64 * MiB)
    a = _pin(rt, hb, 4 * MiB)
    b = hb.extend(4 * MiB, register=False)  # ComfyUI's registration of this one failed: not registered
    hb.truncate(b - hb.get_raw_address(), do_unregister=False)
    assert set(_registered(rt)) == {a}
    hb.close()


def test_a_dropped_buffer_ends_every_registration_before_its_memory_goes(rt):
    hb = HostBuffer(0, 8 * MiB, 64 * MiB)
    for _ in range(3):
        _pin(rt, hb, 4 * MiB)
    hb.extend(4 * MiB, register=False)  # one never registered: asking for it is harmless
    assert len(_registered(rt)) == 3
    del hb
    gc.collect()
    assert _registered(rt) == {}


def test_without_a_session_to_ask_the_memory_stays_mapped(rt):
    hb = HostBuffer(0, 8 * MiB, 64 * MiB)
    _pin(rt, hb, 4 * MiB)
    kept = len(HostBuffer._kept)
    adapter.decided("stock", "stopped", "", None)  # no runtime: nobody can end the registration
    try:
        hb.close()
        assert len(HostBuffer._kept) == kept + 1  # never unmapped while the driver may still lock it
    finally:
        HostBuffer._kept.pop()
        adapter.decided("armed", "test", "membackend test", rt)


def test_the_cuda_driver_tells_a_registration_from_none():
    from membackend._drivers.cuda import CudaDriver
    from membackend._drivers.sim.cuda import SimCudaDriverModule

    m = SimCudaDriverModule(SimPlatform(PROFILES["h200"]))
    d = CudaDriver(m)
    d.init()
    with d.on_device(0):
        assert m.cuMemHostRegister(0x10000, 4096, 1)[0] == d.SUCCESS
        assert d.host_unregister(0x10000) is True
        assert d.host_unregister(0x10000) is False  # CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: none there now


def test_the_hip_driver_leaves_no_last_error_behind_a_refusal():
    m = SimHipModule(SimPlatform(PROFILES["rocm-win-2gpu"]))
    d = HipDriver(m)
    d.init()
    with d.on_device(0):
        assert d.host_unregister(0x10000) is False
        assert m.hipGetLastError()[0] == m.types.hipError_t.hipSuccess  # torch's next launch check sees none
        assert m.hipHostRegister(0x10000, 4096, 0)[0] == d.SUCCESS
        assert d.host_unregister(0x10000) is True


def test_a_long_file_slice_is_read_whole_in_chunks_and_a_short_file_is_refused(tmp_path, monkeypatch):
    """``HostBuffer.read_file_slice`` reads a long slice in chunks on the reader threads, as aimdo's pread pool."""
    from membackend._comfyui import buffers

    monkeypatch.setattr(buffers, "READ_THREADS_FROM", 1)  # the reader threads on any machine

    data = bytes(range(256)) * ((2 * buffers.READ_CHUNK + 12345) // 256 + 1)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    hb = HostBuffer(0, 0, len(data))
    offset = 77
    size = len(data) - offset - 3  # more than two chunks, ending off a chunk's edge
    with open(path, "rb") as f:
        hb.read_file_slice(f, offset, size, offset=0)
        got = bytes((ctypes.c_uint8 * size).from_address(hb.get_raw_address()))
        assert got == data[offset:offset + size]
        with pytest.raises(RuntimeError, match="end of file"):
            hb.read_file_slice(f, len(data) - buffers.READ_CHUNK, 2 * buffers.READ_CHUNK, offset=0)
    hb.close()
