"""On a real CUDA device: the VMM backend through cuda-python. Skipped where there is none."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _cuda_devices() -> int:
    try:
        from membackend._drivers.cuda import CudaDriver

        d = CudaDriver()
        d.init()
        return d.device_count()
    except Exception:
        return 0


requires_cuda = pytest.mark.skipif(_cuda_devices() == 0, reason="no CUDA device")


@requires_cuda
def test_real_round_trip_with_an_event_fence():
    from membackend._backends.vmm import VmmBackend
    from membackend._drivers.cuda import CudaDriver
    from membackend._machine import gather_machine
    from membackend._session import Session
    from membackend.platform import GENERIC

    driver = CudaDriver()
    s = Session(VmmBackend(GENERIC, driver), machine=gather_machine())
    r = s.reserve("cuda:0", 64 * MiB)
    assert s.fault(r, 0, 64 * MiB).ok
    pinned = driver.host_alloc_pinned(64 * MiB)
    stream = driver.stream_create()
    driver.memcpy_htod_async(r.base, pinned, 64 * MiB, stream)
    s.record(r, s.backend.fence_token(r, stream))
    assert s.free(r) == 64 * MiB
    s.release_reservation(r)
    driver.host_free_pinned(pinned)
    b = s.budget_query("cuda:0")
    assert b.total > 0 and b.source.startswith("cuMemGetInfo")


@requires_cuda
def test_the_doctor_selects_vmm_on_a_cuda_machine():
    from membackend._manager import BackendManager
    from membackend._settings import load_settings

    sel = BackendManager(load_settings()).select()
    assert sel.record.name in ("vmm", "aimdo") or sel.candidates["vmm"].score > 0
