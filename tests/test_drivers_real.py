"""The real driver wrappers and comfy-aimdo on a machine without a GPU: typed errors, reasons, no crash."""

from __future__ import annotations

import pytest

from membackend.types import DriverError


def test_cuda_python_without_a_driver_is_a_driver_error():
    pytest.importorskip("cuda.bindings.driver")
    from membackend._drivers.cuda import CudaDriver

    d = CudaDriver()
    try:
        d.init()
    except DriverError as exc:
        assert exc.call == "cuInit"
    else:
        pytest.skip("a CUDA driver is present")


def test_hip_python_without_a_runtime_is_a_driver_error():
    pytest.importorskip("hip")
    from membackend._drivers.hip import HipDriver

    d = HipDriver()
    with pytest.raises(DriverError) as info:
        d.init()
    assert info.value.call == "hipInit" and info.value.code == "unavailable"


def test_aimdo_probe_without_a_gpu_says_so_without_initialising():
    pytest.importorskip("comfy_aimdo")
    from membackend._backends.aimdo import AimdoBackend
    from membackend._machine import gather_machine

    machine = gather_machine()
    if machine.gpus():
        pytest.skip("this machine has a GPU")
    c = AimdoBackend().membackend_probe(machine=machine)
    assert c.score == 0 and "no CUDA or HIP GPU" in c.reason


def test_aimdo_backend_refuses_verbs_with_the_reason():
    pytest.importorskip("comfy_aimdo")
    from membackend._backends.aimdo import AimdoBackend
    from membackend.types import Device

    b = AimdoBackend()
    if b._init(0) is None:
        pytest.skip("comfy-aimdo initialised a device here")
    with pytest.raises(DriverError, match="init_device"):
        b.membackend_reserve(device=Device("cuda", 0), size=1 << 20)


def test_real_discovery_without_a_gpu_lists_nothing_and_says_why():
    from membackend._machine import gather_machine

    machine = gather_machine()
    if machine.gpus():
        pytest.skip("this machine has a GPU")
    assert [line for line in machine.discovery if line.startswith("cuda")]
    assert [line for line in machine.discovery if line.startswith("hip") or "HIP" in line]


def test_the_real_hip_opener_falls_back_to_the_ctypes_binding_and_fails_typed():
    from membackend._drivers import hip_ctypes
    from membackend._drivers.open import open_gpu_driver

    try:
        hip_ctypes.load()
    except DriverError:
        pass
    else:
        pytest.skip("a HIP runtime is installed here")
    with pytest.raises(DriverError) as info:
        open_gpu_driver("hip")
    assert info.value.call in ("dlopen", "hipInit")


def test_the_cuda_wrapper_restores_a_null_context_even_when_the_call_fails():
    """Without a driver every call fails typed, and nothing is left current."""
    pytest.importorskip("cuda.bindings.driver")
    from membackend._drivers.cuda import CudaDriver

    d = CudaDriver()
    try:
        d.init()
    except DriverError:
        pass
    else:
        pytest.skip("a CUDA driver is present")
    d.set_device(1)
    with pytest.raises(DriverError):
        d.mem_get_info()
    d.close()  # nothing retained: nothing to release
