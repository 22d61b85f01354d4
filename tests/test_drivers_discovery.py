"""Machine discovery through the driver wrappers: real calls on simulated drivers, sources, failures, two GPUs.

The simulated drivers answer the same calls the real ones do (cuda-python's and
hip-python's names), so everything here runs the real discovery code; the
ctypes HIP binding runs against a HIP runtime made of ctypes callbacks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import threading
from pathlib import Path

import pytest

from membackend._backends.vmm import VmmBackend
from membackend._drivers import discovery as disc
from membackend._drivers import hip_ctypes
from membackend._drivers.hip import HipDriver
from membackend._drivers.open import bindings_missing, machine_for
from membackend._drivers.sim import FaultPlan, SimCudaDriver, SimHipDriver, SimHost, get_profile, sim_driver
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.platform import GENERIC
from membackend.types import Device, DriverError

MiB, GiB = 1 << 20, 1 << 30

EXPECTED = {"h200": "vmm", "wddm-6gb": "cuda_wddm", "gb10-128gb": "unified_gb10", "rocm-win-2gpu": "rocm_windows",
            "mi100-novmm": "host"}


# --------------------------------------------------------------------------- profiles through discovery


@pytest.mark.parametrize("profile,backend", sorted(EXPECTED.items()))
def test_each_profile_selects_its_backend_from_discovered_facts(profile, backend):
    settings = load_settings(sim_profile=profile)
    machine = machine_for(settings)
    assert machine.overridden == ()  # nothing injected: every fact came from discovery
    sel = BackendManager(settings).select(machine)
    assert sel.record.name == backend, sel.candidates


def test_the_facts_come_from_the_driver_calls_and_say_so():
    wddm = machine_for(load_settings(sim_profile="wddm-6gb"))
    d = wddm.devices[0]
    assert (d.driver_model, d.source_of("driver_model")) == ("wddm", "cuda: cuDeviceGetAttribute(TCC_DRIVER)")
    assert d.source_of("vmm_supported") == "cuda: cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)"
    assert d.luid and d.source_of("luid") == "cuda: cuDeviceGetLuid"
    assert (wddm.os, wddm.source_of("os")) == ("windows", "sim:wddm-6gb: the simulated OS")
    gb10 = machine_for(load_settings(sim_profile="gb10-128gb")).devices[0]
    assert gb10.integrated and gb10.unified and gb10.source_of("integrated") == "cuda: cuDeviceGetAttribute(INTEGRATED)"
    assert gb10.driver_model is None and gb10.luid is None  # not asked off Windows
    rocm = machine_for(load_settings(sim_profile="rocm-win-2gpu"))
    assert rocm.torch_vendor == "rocm" and [d.arch for d in rocm.gpus("hip")] == ["gfx1201", "gfx1201"]
    assert rocm.devices[1].source_of("arch") == "hip: hipGetDeviceProperties(.gcnArchName)"
    assert rocm.devices[0].luid != rocm.devices[1].luid
    novmm = machine_for(load_settings(sim_profile="mi100-novmm")).devices[0]
    assert novmm.vmm_supported is False
    assert novmm.source_of("vmm_supported") == "hip: hipDeviceGetAttribute(VirtualMemoryManagementSupported)"


def test_every_vmm_probe_requires_virtual_memory_management():
    settings = load_settings(sim_profile="mi100-novmm")
    sel = BackendManager(settings).select(machine_for(settings))
    for name in ("vmm", "aimdo"):
        c = sel.candidates[name]
        assert c.score == 0 and "virtual memory management" in c.reason, c


def test_user_overrides_win_and_are_sourced_as_the_users():
    m = machine_for(load_settings(sim_profile="h200", machine={"os": "windows"}))
    assert m.os == "windows" and m.overridden == ("os",)
    assert m.source_of("os").startswith("user override MEMBACKEND_MACHINE__OS")
    assert m.devices[0].source_of("name") == "cuda: cuDeviceGetName"  # the rest is still discovered


# --------------------------------------------------------------------------- failures are recorded, never raised


def test_a_failing_attribute_leaves_the_fact_unknown_and_the_vmm_probe_at_zero():
    plan = FaultPlan()
    plan.add("cuDeviceGetAttribute", 1, probability=1.0)
    profile = get_profile("h200")
    found = disc.discover(disc.Bindings(host=SimHost(profile), cuda=lambda: sim_driver(profile, plan)))
    d = found.devices[0]
    assert d.name == "NVIDIA H200" and d.vmm_supported is None and d.source_of("vmm_supported") is None
    assert any("did not answer for" in line and "vmm_supported" in line for line in found.discovery)
    m = disc.assemble(found, SimHost(profile).memory())
    c = GENERIC.probe(m)
    assert c.score == 0 and "unknown" in c.reason


class _Broken:
    label = "broken"

    def init(self):
        raise RuntimeError("nobody expected this")


def test_a_binding_that_breaks_lists_nothing_and_says_why():
    def no_binding():
        raise ImportError("cuda-python is not installed")

    found = disc.discover(disc.Bindings(host=disc.RealHost(), cuda=_Broken, hip=(no_binding,)))
    assert found.devices == ()
    assert any("discovery failed (RuntimeError: nobody expected this)" in line for line in found.discovery)
    assert "hip: cuda-python is not installed" in found.discovery


def test_no_device_visible_is_no_answer_not_an_error():
    profile = get_profile("h200")
    found = disc.discover(disc.Bindings(host=SimHost(profile), cuda=lambda: sim_driver(
        profile, environ={"CUDA_VISIBLE_DEVICES": ""})))
    assert found.devices == () and "CUDA_ERROR_NO_DEVICE" in found.discovery[0]


# --------------------------------------------------------------------------- visibility


def test_visible_ordinals_follow_the_cuda_rules():
    v = disc.visible_ordinals
    assert v(3, "cuda", {}) == [0, 1, 2]
    assert v(3, "cuda", {"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert v(3, "cuda", {"CUDA_VISIBLE_DEVICES": "0,7,1"}) == [0]  # the list stops at an invalid entry
    assert v(3, "cuda", {"CUDA_VISIBLE_DEVICES": "-1"}) == [] and v(3, "cuda", {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert v(2, "hip", {"CUDA_VISIBLE_DEVICES": "1"}) == [1]
    assert v(2, "hip", {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}) == [0]


def _two_gpu_cuda(names=("NVIDIA H200", "NVIDIA H200")):
    base = get_profile("h200")
    spec = base.devices[0]
    return dataclasses.replace(base, name="h200-2gpu",
                               devices=tuple(dataclasses.replace(spec, name=n) for n in names))


def test_the_simulated_driver_renumbers_what_cuda_visible_devices_leaves():
    profile = _two_gpu_cuda(("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    found = disc.discover(disc.Bindings(host=SimHost(profile), cuda=lambda: sim_driver(
        profile, environ={"CUDA_VISIBLE_DEVICES": "1"})))
    assert [(str(d.device), d.name) for d in found.devices] == [("cuda:0", "NVIDIA H100 80GB HBM3")]


# --------------------------------------------------------------------------- two GPUs: the caller's device stays


def _vmm_round_trip_on_device_1(driver):
    backend = VmmBackend(GENERIC, driver)
    dev = Device(driver.vendor, 1)
    r = backend.membackend_reserve(device=dev, size=64 * MiB)
    assert backend.membackend_fault(reservation=r, offset=0, size=64 * MiB).ok
    assert driver.inspect(1)["mapped"] == 64 * MiB and driver.inspect(0)["reserved"] == 0  # it ran on device 1
    backend.membackend_budget_query(device=dev)
    stream = (driver.set_device(1), driver.stream_create())[1]
    token = backend.fence_token(r, stream)
    token.wait()
    assert backend.membackend_free(reservation=r, offset=0, size=64 * MiB) == 64 * MiB
    backend.membackend_release_reservation(reservation=r)
    assert driver.inspect(1)["reserved"] == 0


def _discover_and_probe(platform, host, opener_kind):
    found = disc.discover(disc.Bindings(host=host, **opener_kind))
    machine = disc.assemble(found, host.memory())
    assert len(machine.gpus()) == 2
    assert GENERIC.probe(machine).score > 0
    return machine


@pytest.mark.parametrize("caller_context", [True, False], ids=["torch-context-current", "no-context-yet"])
def test_cuda_two_gpus_the_callers_context_is_unchanged_and_retains_are_released(caller_context):
    profile = _two_gpu_cuda()
    driver = sim_driver(profile)
    driver.init()
    m, sim = driver.m, driver.sim
    torch_ctx = 0
    if caller_context:  # what torch does on cuda:0: retain the primary context and make it current
        torch_ctx = int(m.cuDevicePrimaryCtxRetain(m.types.CUdevice(0))[1])
        m.cuCtxSetCurrent(m.types.CUcontext(torch_ctx))
    _discover_and_probe(sim, SimHost(profile), {"cuda": lambda: SimCudaDriver(sim)})
    assert driver.current_context() == torch_ctx
    assert [d.primary_refs for d in sim.devices] == [int(caller_context), 0]  # discovery retains nothing
    _vmm_round_trip_on_device_1(driver)
    assert driver.current_context() == torch_ctx
    if caller_context:
        assert driver.current_device() == 0
    driver.close()
    assert [d.primary_refs for d in sim.devices] == [int(caller_context), 0]


def test_hip_two_gpus_the_callers_device_is_unchanged():
    driver = sim_driver("rocm-win-2gpu")
    driver.init()
    driver.m.hipSetDevice(0)  # torch's current device
    _discover_and_probe(driver.sim, SimHost("rocm-win-2gpu"), {"hip": (lambda: SimHipDriver(driver.sim),)})
    _vmm_round_trip_on_device_1(driver)
    assert driver.current_device() == 0


def test_the_current_device_is_per_thread():
    driver = sim_driver("rocm-win-2gpu")
    driver.init()
    seen = {}

    def other():
        driver.m.hipSetDevice(1)
        seen["other"] = driver.current_device()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["other"] == 1 and driver.current_device() == 0


def test_a_failing_call_still_restores_the_callers_device():
    driver = sim_driver("rocm-win-2gpu")
    driver.init()
    driver.set_device(1)
    with pytest.raises(DriverError):
        driver.create(3 * MiB, 1)  # not a multiple of the granularity
    assert driver.current_device() == 0


# --------------------------------------------------------------------------- the bindings' names


def _called(path: Path, prefix: str) -> set[str]:
    return set(re.findall(rf'(?:call|_on)\("({prefix}\w+)"', path.read_text()))


def test_every_cuda_call_exists_in_the_bindings_and_the_simulation():
    import membackend._drivers.cuda as cuda_mod

    names = _called(Path(cuda_mod.__file__), "cu")
    assert {"cuInit", "cuDeviceGetAttribute", "cuDeviceGetLuid", "cuCtxGetCurrent", "cuCtxSetCurrent",
            "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuDeviceTotalMem"} <= names
    real = pytest.importorskip("cuda.bindings.driver")
    assert sorted(n for n in names if not hasattr(real, n)) == []
    sim = sim_driver("h200").m
    missing = [n for n in names if not callable(getattr(type(sim), n, None))]
    assert sorted(missing) == ["cuMemAlloc", "cuMemFree"]  # baselines for real hardware only


def test_every_hip_call_exists_in_hip_python_the_ctypes_binding_and_the_simulation():
    import membackend._drivers.hip as hip_mod

    names = _called(Path(hip_mod.__file__), "hip")
    runtime = hip_ctypes.HipRuntime(object())
    assert sorted(n for n in names if not callable(getattr(runtime, n, None))) == []
    sim = sim_driver("rocm-win-2gpu").m
    assert sorted(n for n in names if not callable(getattr(type(sim), n, None))) == []
    try:
        from hip import hip
    except ImportError:
        pytest.skip("hip-python is not installed")
    assert sorted(n for n in names if not hasattr(hip, n)) == []


def test_the_ctypes_constants_and_layouts_match_hip_python():
    hip = pytest.importorskip("hip").hip
    for enum in (hip_ctypes.hipError_t, hip_ctypes.hipDeviceAttribute_t, hip_ctypes.hipMemAllocationType,
                 hip_ctypes.hipMemLocationType, hip_ctypes.hipMemAccessFlags,
                 hip_ctypes.hipMemAllocationGranularity_flags):
        theirs = getattr(hip, enum.__name__)
        assert {m.name: int(m) for m in enum} == {m.name: int(getattr(theirs, m.name)) for m in enum}
    assert hip_ctypes.hipEventDisableTiming == hip.hipEventDisableTiming
    for ours in (hip_ctypes.hipMemAllocationProp, hip_ctypes.hipMemAccessDesc):
        theirs = getattr(hip, ours.__name__)
        assert ctypes.sizeof(ours) == theirs.c_sizeof(theirs())
    props = hip.hipDeviceProp_t()
    assert hip.hipDeviceProp_t.c_sizeof(props) == hip_ctypes.PROPS_SIZE
    addr = props.as_c_void_p().value
    for name, value in (("totalGlobalMem", 0x1122334455667788), ("integrated", 7), ("major", 12), ("minor", 3),
                        ("luidDeviceNodeMask", 5)):
        setattr(props, name, value)
        size = 8 if name == "totalGlobalMem" else 4
        assert int.from_bytes(ctypes.string_at(addr + hip_ctypes.PROPS_OFFSETS[name], size), "little") == value
    for name in ("name", "gcnArchName"):  # char arrays are read-only in hip-python: write the bytes, read the field
        ctypes.memmove(addr + hip_ctypes.PROPS_OFFSETS[name], b"gfx1201:xnack-\0", 15)
        assert getattr(props, name).startswith("gfx1201")
    ctypes.memmove(addr + hip_ctypes.PROPS_OFFSETS["luid"], b"\x01\x02\x03\x04\x05\x06\x07\x08", 8)
    assert bytes(props.luid) == b"\x01\x02\x03\x04\x05\x06\x07\x08"


# --------------------------------------------------------------------------- the ctypes binding, end to end


class FakeHipRuntime:
    """A HIP runtime of ctypes callbacks with the C signatures of hip_runtime_api.h: two devices,
    a per-thread current device, and a log of (call, current device, device argument)."""

    def __init__(self, names=("AMD Radeon RX 9070 XT", "AMD Radeon RX 9070 XT")):
        c = ctypes
        self.names = names
        self.log: list[tuple[str, int, int | None]] = []
        self._tls = threading.local()
        self._next = 0x7000_0000_0000
        i, sz, vp, ull, uint = c.c_int, c.c_size_t, c.c_void_p, c.c_ulonglong, c.c_uint
        P = c.POINTER
        prop, desc = P(hip_ctypes.hipMemAllocationProp), P(hip_ctypes.hipMemAccessDesc)
        specs = {
            "hipInit": ((uint,), lambda flags: 0),
            "hipGetDeviceCount": ((P(i),), self._count),
            "hipGetDevice": ((P(i),), self._get),
            "hipSetDevice": ((i,), self._set),
            "hipDriverGetVersion": ((P(i),), lambda out: self._put(out, 100_000_000)),
            "hipGetDevicePropertiesR0600": ((vp, i), self._props),
            "hipDeviceGetAttribute": ((P(i), i, i), lambda out, attr, dev: self._put(out, int(attr == 89))),
            "hipMemGetAllocationGranularity": ((P(sz), prop, i), lambda out, p, o: self._put(out, 2 * MiB)),
            "hipMemAddressReserve": ((P(vp), sz, sz, vp, ull), self._reserve),
            "hipMemCreate": ((P(vp), sz, prop, ull), self._create),
            "hipMemMap": ((vp, sz, sz, vp, ull), lambda p, s, o, h, f: self._note("hipMemMap")),
            "hipMemSetAccess": ((vp, sz, desc, sz), lambda p, s, d, n: self._note("hipMemSetAccess", d[0].location.id)),
            "hipMemUnmap": ((vp, sz), lambda p, s: self._note("hipMemUnmap")),
            "hipMemRelease": ((vp,), lambda h: self._note("hipMemRelease")),
            "hipMemAddressFree": ((vp, sz), lambda p, s: self._note("hipMemAddressFree")),
            "hipMemGetInfo": ((P(sz), P(sz)), self._meminfo),
        }
        self._keep = {}
        for name, (argtypes, fn) in specs.items():
            self._keep[name] = c.CFUNCTYPE(c.c_int, *argtypes)(fn)
            setattr(self, name, self._keep[name])

    @property
    def current(self) -> int:
        return getattr(self._tls, "device", 0)

    @staticmethod
    def _put(out, value) -> int:
        out[0] = value
        return 0

    def _note(self, call, device=None) -> int:
        self.log.append((call, self.current, device))
        return 0

    def _count(self, out):
        return self._put(out, len(self.names))

    def _get(self, out):
        return self._put(out, self.current)

    def _set(self, device):
        if not 0 <= device < len(self.names):
            return 101  # hipErrorInvalidDevice
        self._tls.device = device
        return 0

    def _props(self, buf, device):
        o = hip_ctypes.PROPS_OFFSETS

        def put(field, data):
            ctypes.memmove(buf + o[field], data, len(data))
        put("name", self.names[device].encode() + b"\0")
        put("gcnArchName", b"gfx1201:sramecc-:xnack-\0")
        put("totalGlobalMem", (16 * GiB).to_bytes(8, "little"))
        put("integrated", (0).to_bytes(4, "little"))
        put("luid", (0x100 + device).to_bytes(4, "little") + bytes(4))
        return 0

    def _reserve(self, out, size, alignment, addr, flags):
        self._note("hipMemAddressReserve")
        out[0] = self._next
        self._next += size
        return 0

    def _create(self, out, size, prop, flags):
        self._note("hipMemCreate", prop[0].location.id)
        out[0] = 0x1234
        return 0

    def _meminfo(self, free, total):
        self._note("hipMemGetInfo")
        free[0], total[0] = 8 * GiB, 16 * GiB
        return 0


class _WindowsHost(disc.RealHost):
    def os_name(self):
        return "windows", "test"


def test_the_ctypes_binding_discovers_through_the_runtimes_calls():
    fake = FakeHipRuntime(("AMD Radeon RX 9070 XT", "AMD Radeon RX 7900 XTX"))
    found = disc.discover(disc.Bindings(host=_WindowsHost(), hip=(lambda: HipDriver(hip_ctypes.HipRuntime(fake, "fake")),)))
    assert [(str(d.device), d.name, d.arch, d.total_memory, d.vmm_supported) for d in found.devices] == [
        ("hip:0", "AMD Radeon RX 9070 XT", "gfx1201", 16 * GiB, True),
        ("hip:1", "AMD Radeon RX 7900 XTX", "gfx1201", 16 * GiB, True)]
    assert found.devices[1].luid == "0000000000000101" and "HIP runtime via ctypes (fake)" in found.devices[0].source
    assert "runtime 10.0.0" in found.discovery[-1]


def test_the_ctypes_binding_marshals_the_vmm_calls_on_the_selected_device_and_restores_the_callers():
    fake = FakeHipRuntime()
    d = HipDriver(hip_ctypes.HipRuntime(fake, "fake"))
    d.init()
    d.set_device(1)
    va = d.address_reserve(4 * MiB, 2 * MiB)
    h = d.create(2 * MiB, 1)
    d.map(va, 2 * MiB, h)
    d.set_access(va, 2 * MiB, 1)
    assert d.mem_get_info() == (8 * GiB, 16 * GiB)
    d.unmap(va, 2 * MiB)
    d.release(h)
    d.address_free(va, 4 * MiB)
    assert d.granularity(1) == 2 * MiB
    assert {(call, current) for call, current, _ in fake.log} == {(c, 1) for c, _, _ in fake.log}  # all on device 1
    assert ("hipMemCreate", 1, 1) in fake.log and ("hipMemSetAccess", 1, 1) in fake.log
    assert d.current_device() == 0  # the caller's device, as it found it
    with pytest.raises(DriverError) as info:
        HipDriver(hip_ctypes.HipRuntime(fake, "fake")).call("hipSetDevice", 5)
    assert info.value.code == hip_ctypes.hipError_t.hipErrorInvalidDevice


def test_the_runtime_is_looked_for_next_to_torch_first_and_a_miss_is_a_typed_error(tmp_path, monkeypatch):
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    name = hip_ctypes._names()[0]
    (lib / name).write_bytes(b"not a library")
    monkeypatch.setattr(hip_ctypes, "_torch_lib", lambda: lib)
    monkeypatch.setenv(hip_ctypes.LIBRARY_ENV, str(tmp_path / "explicit.so"))
    order = hip_ctypes.candidates()
    assert order[:2] == [str(tmp_path / "explicit.so"), str(lib / name)]
    with pytest.raises(DriverError) as info:
        hip_ctypes.load()
    assert info.value.call == "dlopen" and str(lib / name) in str(info.value)


def test_without_hip_python_or_a_runtime_the_hip_binding_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_hip(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == "hip" or name.startswith("hip.")):
            raise ImportError("No module named 'hip'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_hip)
    monkeypatch.setattr(hip_ctypes, "candidates", lambda: ["/nonexistent/libamdhip64.so"])
    why = bindings_missing("hip")
    assert "hip-python is not installed" in why and "ROCm build of torch" in why
    assert bindings_missing("hip", simulated=True) is None  # the simulation needs neither


def test_the_simulated_hip_driver_runs_on_the_ctypes_bindings_types_without_hip_python(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_hip(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == "hip" or name.startswith("hip.")):
            raise ImportError("No module named 'hip'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_hip)
    d = sim_driver("rocm-win-2gpu")
    assert d.m.types is hip_ctypes
    d.init()
    _vmm_round_trip_on_device_1(d)
    assert d.current_device() == 0


def _fake_nvml(monkeypatch, *, memory_raises=False):
    """nvidia-ml-py's ``pynvml`` for one board at PCI 0000:01:00 (where the simulated device 0 sits)."""
    import sys
    import types

    m = types.ModuleType("pynvml")
    m.NVML_DRIVER_WDDM = 0

    def memory(h):
        if memory_raises:  # GB10: "Not Supported"
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return types.SimpleNamespace(total=6 * GiB)
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: object()
    m.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 3050"
    m.nvmlDeviceGetMemoryInfo = memory
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(domain=0, bus=1, device=0)
    m.nvmlDeviceGetDriverModel = lambda h: (0, 0)
    monkeypatch.setitem(sys.modules, "pynvml", m)


def test_nvml_fills_what_cuda_did_not_answer_for_the_same_board(monkeypatch):
    _fake_nvml(monkeypatch)
    profile = get_profile("wddm-6gb")
    found = disc.discover(disc.Bindings(host=SimHost(profile), cuda=lambda: sim_driver(profile), nvml=True))
    assert found.devices[0].source_of("driver_model") == "cuda: cuDeviceGetAttribute(TCC_DRIVER)"  # CUDA answered
    assert "nvml: 1 device(s)" in found.discovery

    def no_tcc_answer():
        d = sim_driver(profile)

        def fails(index, os_name=None):
            raise DriverError("unavailable", "cuDeviceGetAttribute", "TCC_DRIVER did not answer")
        d.driver_model = fails
        return d
    found = disc.discover(disc.Bindings(host=SimHost(profile), cuda=no_tcc_answer, nvml=True))
    d = found.devices[0]
    assert (d.driver_model, d.source_of("driver_model")) == ("wddm", "nvml: nvmlDeviceGetDriverModel")
    assert d.source_of("name") == "cuda: cuDeviceGetName"


def test_nvml_lists_devices_only_when_cuda_did_not_answer_and_vmm_stays_unknown(monkeypatch):
    _fake_nvml(monkeypatch, memory_raises=True)

    def no_cuda():
        raise DriverError("unavailable", "dlopen", "libcuda.so.1 is not on the library search path")

    found = disc.discover(disc.Bindings(host=SimHost("gb10-128gb"), cuda=no_cuda, nvml=True))
    d = found.devices[0]
    assert (d.name, d.total_memory, d.source) == ("NVIDIA GeForce RTX 3050", 0, "nvml")  # memory: no answer
    assert d.vmm_supported is None
    m = disc.assemble(found, SimHost("gb10-128gb").memory())
    assert GENERIC.probe(m).score == 0
