"""The comfy-aimdo backend against aimdo's real module shapes (0.6.0 and 0.5.5), with no GPU.

A fake ``comfy_aimdo`` package written to a temporary directory behaves like
the real one where the backend depends on it: ``control.devctxs`` holds bare
pointers, ``control.get_devctx`` raises for a device aimdo has not
initialised, ``init_devices`` refuses a second call, ``model_vbar`` binds
``control.lib`` when it is imported, and ``ModelVBAR.close()`` exists only in
0.6.0 (0.5.5 frees in ``__del__``). Nothing here initialises a real device.
"""

from __future__ import annotations

import gc
import importlib
import sys
import textwrap

import pytest

from membackend._backends.aimdo import SCORE, VBAR_PAGE_SIZE, AimdoBackend
from membackend.types import Device, DeviceInfo, DriverError, Machine, Score, WrongDevice

PAGE = VBAR_PAGE_SIZE

CONTROL = '''
import logging

lib = None
devctxs = []  # bare pointers, as aimdo keeps them
EVENTS = []
FAIL_INIT = None  # a reason: init() logs it and returns False, like a library that does not load
CAPACITY_PAGES = 1 << 20
_devices = set()


class Lib:
    def __init__(self):
        self.freed = []
        self.next = 0x7F0000000000

    def vbar_allocate(self, devctx, size, device):
        ptr, self.next = self.next, self.next + size
        return ptr

    def vbar_free(self, devctx, ptr):
        self.freed.append(ptr)


def init(implementation=None, simple_vram_headroom=None, nvml_pressure=False):
    global lib
    EVENTS.append(("init", implementation))
    if lib is not None:
        return True
    if FAIL_INIT:
        logging.info(FAIL_INIT)
        return False
    lib = Lib()
    return True


def init_devices(device_ids):
    global devctxs
    EVENTS.append(("init_devices", list(device_ids)))
    if lib is None:
        return False
    if devctxs:
        logging.warning("comfy-aimdo devices are already initialized, call deinit() first")
        return False
    _devices.update(device_ids)
    devctxs = [0xD000 + d for d in device_ids]
    return True


def init_device(device_id, extra_vram_headroom=0):
    return init_devices([device_id])


def get_devctx(device_id):
    EVENTS.append(("get_devctx", device_id))
    if lib is None:
        raise AttributeError("'NoneType' object has no attribute 'get_devctx'")
    if device_id in _devices:
        return 0xD000 + device_id
    raise RuntimeError(f"comfy-aimdo device {device_id} is not initialized")
'''

MODEL_VBAR = '''
from . import control

lib = control.lib  # bound at import, as aimdo's is
PAGE = 32 << 20
control.EVENTS.append(("import model_vbar", lib is not None))


class ModelVBAR:
    def __init__(self, size, device):
        self._devctx = control.get_devctx(device)
        self._ptr = lib.vbar_allocate(self._devctx, int(size), device)
        self.nr_pages = min(-(-size // PAGE), control.CAPACITY_PAGES)
        self.base_addr = self._ptr
        self.resident = {}
        self.serial = 0

    def fault(self, alloc, size):
        first, last = (alloc - self.base_addr) // PAGE, (alloc - self.base_addr + size - 1) // PAGE
        signature = []
        for page in range(first, last + 1):
            if page not in self.resident:
                self.serial += 1
                self.resident[page] = self.serial
            signature.append(self.resident[page])
        return signature + [0, 0]  # aimdo sizes the array with spare slots

    def unpin(self, alloc, size):
        pass

    def loaded_size(self):
        return len(self.resident) * PAGE

    def set_watermark(self, size_bytes):
        for page in [p for p in self.resident if p >= size_bytes // PAGE]:
            del self.resident[page]

    def get_nr_pages(self):
        return self.nr_pages
{finaliser}
'''

FINALISER_060 = '''
    def close(self):
        ptr = getattr(self, "_ptr", None)
        if control.lib is not None and ptr:
            control.lib.vbar_free(self._devctx, ptr)
            self._ptr = None

    def __del__(self):
        self.close()
'''

FINALISER_055 = '''
    def __del__(self):
        ptr = getattr(self, "_ptr", None)
        if control.lib is not None and ptr:
            control.lib.vbar_free(self._devctx, ptr)
            self._ptr = None
'''

VERSIONS = {"0.6.0": FINALISER_060, "0.5.5": FINALISER_055}


def _aimdo_modules() -> dict:
    return {k: v for k, v in sys.modules.items() if k == "comfy_aimdo" or k.startswith("comfy_aimdo.")}


@pytest.fixture(params=sorted(VERSIONS))
def fake_aimdo(request, tmp_path, monkeypatch):
    """A fake ``comfy_aimdo`` of the parametrised version, importable under the real name; yields its control."""
    package = tmp_path / "comfy_aimdo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "control.py").write_text(CONTROL)
    (package / "model_vbar.py").write_text(MODEL_VBAR.replace("{finaliser}", textwrap.dedent(VERSIONS[request.param])
                                                                 .replace("\n", "\n    ").rstrip()))
    saved = _aimdo_modules()
    for name in saved:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    control = importlib.import_module("comfy_aimdo.control")
    control.VERSION = request.param
    try:
        yield control
    finally:
        gc.collect()  # finalisers of fake VBARs run against the fake, not later against the real package
        for name in _aimdo_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def machine(*devices: Device, os: str = "linux") -> Machine:
    return Machine(os=os, cpus=2, ram_total=16 << 30, ram_available=8 << 30, cgroup_limit=None, torch_version=None,
                   torch_vendor=None, devices=tuple(DeviceInfo(d, "fake GPU", 8 << 30) for d in devices))


def host_application_initialised(control, *indices: int):
    """What ComfyUI does at start-up: init, init_devices, then import model_vbar."""
    control.init("cuda")
    control.init_devices(list(indices))
    model_vbar = importlib.import_module("comfy_aimdo.model_vbar")
    control.EVENTS.clear()
    return model_vbar


CUDA0 = Device("cuda", 0)


# ---------------------------------------------------------------------------- probe


def test_probe_detects_a_gpu_without_initialising_anything(fake_aimdo):
    c = AimdoBackend().membackend_probe(machine=machine(CUDA0))
    assert (c.name, c.score) == ("aimdo", SCORE) and SCORE in Score.GENERIC, c
    assert fake_aimdo.EVENTS == [], f"the probe called into aimdo: {fake_aimdo.EVENTS}"
    assert fake_aimdo.lib is None
    assert "comfy_aimdo.model_vbar" not in sys.modules


def test_probe_without_a_gpu_does_not_fit(fake_aimdo):
    c = AimdoBackend().membackend_probe(machine=machine())
    assert c.score == 0 and "no CUDA or HIP GPU" in c.reason, c
    assert fake_aimdo.EVENTS == []


def test_probe_on_an_os_aimdo_does_not_ship_for(fake_aimdo):
    c = AimdoBackend().membackend_probe(machine=machine(CUDA0, os="darwin"))
    assert c.score == 0 and "darwin" in c.reason, c


def test_probe_without_the_package_says_how_to_install_it():
    def missing():
        raise ImportError("No module named 'comfy_aimdo'")

    c = AimdoBackend(control=missing).membackend_probe(machine=machine(CUDA0))
    assert c.score == 0 and "membackend[aimdo]" in c.reason, c


def test_probe_of_the_real_package_initialises_nothing(monkeypatch):
    control = pytest.importorskip("comfy_aimdo.control")
    for name in ("init", "init_devices", "init_device", "get_devctx", "deinit"):
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"the probe called comfy_aimdo.control.{_name}")

        monkeypatch.setattr(control, name, refuse)
    lib_before = control.lib
    had_model_vbar = "comfy_aimdo.model_vbar" in sys.modules
    c = AimdoBackend().membackend_probe(machine=machine(CUDA0))
    assert c.score == SCORE, c
    assert control.lib is lib_before
    assert ("comfy_aimdo.model_vbar" in sys.modules) == had_model_vbar


# ---------------------------------------------------------------------------- initialisation


def test_uses_devices_the_host_application_already_initialised(fake_aimdo):
    model_vbar = host_application_initialised(fake_aimdo, 0)
    b = AimdoBackend(control=fake_aimdo, model_vbar=model_vbar)
    r = b.membackend_reserve(device=CUDA0, size=3 * PAGE)
    assert r.size == 3 * PAGE
    called = [e[0] for e in fake_aimdo.EVENTS]
    assert "init" not in called and "init_devices" not in called, fake_aimdo.EVENTS
    assert ("get_devctx", 0) in fake_aimdo.EVENTS
    b.membackend_release_reservation(reservation=r)


def test_initialises_aimdo_before_importing_model_vbar(fake_aimdo):
    b = AimdoBackend()
    r = b.membackend_reserve(device=CUDA0, size=PAGE + 1)
    events = fake_aimdo.EVENTS
    assert events.index(("init", "cuda")) < events.index(("init_devices", [0])) < events.index(("import model_vbar", True))
    assert ("import model_vbar", False) not in events
    assert sys.modules["comfy_aimdo.model_vbar"].lib is fake_aimdo.lib
    assert r.size == 2 * PAGE and r.requested == PAGE + 1
    b.membackend_release_reservation(reservation=r)


def test_rebinds_a_model_vbar_imported_before_init(fake_aimdo):
    early = importlib.import_module("comfy_aimdo.model_vbar")
    assert early.lib is None
    b = AimdoBackend()
    r = b.membackend_reserve(device=CUDA0, size=PAGE)
    assert sys.modules["comfy_aimdo.model_vbar"].lib is fake_aimdo.lib
    b.membackend_release_reservation(reservation=r)


def test_a_stale_model_vbar_that_cannot_be_reloaded_is_a_typed_error(fake_aimdo):
    import types

    stale = types.ModuleType("stale_model_vbar")  # no spec: cannot be re-run
    stale.lib = None
    b = AimdoBackend(control=fake_aimdo, model_vbar=stale)
    with pytest.raises(DriverError, match="imported before comfy_aimdo.control.init"):
        b.membackend_reserve(device=CUDA0, size=PAGE)


def test_hip_devices_initialise_aimdo_for_rocm(fake_aimdo):
    b = AimdoBackend()
    r = b.membackend_reserve(device=Device("hip", 0), size=PAGE)
    assert ("init", "rocm") in fake_aimdo.EVENTS
    b.membackend_release_reservation(reservation=r)


def test_verbs_report_aimdos_own_reason_once_init_fails(fake_aimdo):
    fake_aimdo.FAIL_INIT = "comfy-aimdo failed to load: libcuda.so.1: cannot open shared object file"
    b = AimdoBackend()
    assert b.membackend_probe(machine=machine(CUDA0)).score == SCORE  # the probe cannot know, and must not try
    for _ in range(2):
        with pytest.raises(DriverError) as info:
            b.membackend_reserve(device=CUDA0, size=PAGE)
        assert info.value.call == "comfy_aimdo.control.init" and "libcuda.so.1" in str(info.value)
    assert [e for e in fake_aimdo.EVENTS if e[0] == "init"] == [("init", "cuda")]  # tried once


def test_two_gpus_are_initialised_in_one_call_aimdo_accepts_once(fake_aimdo):
    """comfy-aimdo 0.6.0 refuses a second init_devices: every device the probe saw goes in the first."""
    b = AimdoBackend()
    assert b.membackend_probe(machine=machine(CUDA0, Device("cuda", 1))).score == SCORE
    r0 = b.membackend_reserve(device=CUDA0, size=PAGE)
    r1 = b.membackend_reserve(device=Device("cuda", 1), size=PAGE)
    assert [e for e in fake_aimdo.EVENTS if e[0] == "init_devices"] == [("init_devices", [0, 1])]
    b.membackend_release_reservation(reservation=r0)
    b.membackend_release_reservation(reservation=r1)


def test_a_device_aimdo_was_not_initialised_for_is_a_typed_error_with_its_reason(fake_aimdo):
    fake_aimdo.init()
    fake_aimdo.init_devices([0])  # ComfyUI initialised aimdo for device 0 only
    b = AimdoBackend()
    r = b.membackend_reserve(device=CUDA0, size=PAGE)
    with pytest.raises(DriverError) as info:
        b.membackend_reserve(device=Device("cuda", 1), size=PAGE)
    assert info.value.call == "comfy_aimdo.control.init_devices" and "initialises its devices once" in str(info.value)
    b.membackend_release_reservation(reservation=r)


def test_a_cpu_device_is_refused(fake_aimdo):
    with pytest.raises(WrongDevice):
        AimdoBackend().membackend_reserve(device=Device("cpu", 0), size=PAGE)
    assert fake_aimdo.EVENTS == []


# ---------------------------------------------------------------------------- the VBAR lifecycle


def test_release_frees_the_vbar_on_every_version(fake_aimdo):
    b = AimdoBackend()
    r = b.membackend_reserve(device=CUDA0, size=4 * PAGE)
    f = b.membackend_fault(reservation=r, offset=PAGE, size=2 * PAGE)
    assert f.ok and f.first_page == 1 and len(f.generations) == 2 and f.mapped == 2 * PAGE
    assert b.membackend_release_reservation(reservation=r) == 2 * PAGE
    assert fake_aimdo.lib.freed == [r.base], f"aimdo {fake_aimdo.VERSION}: VBAR not freed at release"
    assert r.handle is None


def test_release_frees_at_once_even_while_someone_else_holds_the_vbar(fake_aimdo):
    b = AimdoBackend()
    r = b.membackend_reserve(device=CUDA0, size=PAGE)
    held = r.handle  # a stray reference (a trace, a traceback) must not delay the free
    b.membackend_release_reservation(reservation=r)
    assert fake_aimdo.lib.freed == [r.base]
    del held
    gc.collect()
    assert fake_aimdo.lib.freed == [r.base], "freed twice"


def test_free_drops_pages_from_the_watermark_up(fake_aimdo):
    b = AimdoBackend()
    r = b.membackend_reserve(device=CUDA0, size=4 * PAGE)
    b.membackend_fault(reservation=r, offset=0, size=4 * PAGE)
    assert b.membackend_free(reservation=r, offset=PAGE, size=PAGE) == 0  # below the top: aimdo cannot
    assert b.membackend_free(reservation=r, offset=2 * PAGE, size=2 * PAGE) == 2 * PAGE
    again = b.membackend_fault(reservation=r, offset=3 * PAGE, size=PAGE)
    assert again.ok and again.mapped == PAGE
    b.membackend_release_reservation(reservation=r)


def test_a_vbar_aimdo_clamped_below_the_request_is_refused_and_freed(fake_aimdo):
    fake_aimdo.CAPACITY_PAGES = 2  # aimdo clamps every VBAR to the card's capacity
    b = AimdoBackend()
    with pytest.raises(DriverError, match="clamped"):
        b.membackend_reserve(device=CUDA0, size=3 * PAGE)
    assert len(fake_aimdo.lib.freed) == 1, "the clamped VBAR stayed reserved"


# ---------------------------------------------------------------------------- budget


class _Driver:
    """A driver wrapper's budget seam, counting how often it is opened and initialised."""

    opened = 0

    def __init__(self):
        type(self).opened += 1
        self.inits = 0

    def init(self):
        self.inits += 1

    def budget(self, source, index):
        assert (source, index) == ("device", 0)
        return 8 << 30, 6 << 30, "cuMemGetInfo (fake)"


def test_budget_without_torch_comes_from_the_device_driver(fake_aimdo, monkeypatch):
    import membackend._backends.aimdo as aimdo

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    _Driver.opened = 0
    monkeypatch.setattr(aimdo, "open_gpu_driver", lambda kind: _Driver())
    b = AimdoBackend()
    for _ in range(2):
        budget = b.membackend_budget_query(device=CUDA0)
        assert (budget.total, budget.free, budget.headroom) == (8 << 30, 6 << 30, aimdo.DEFAULT_HEADROOM)
        assert budget.source == "cuMemGetInfo (fake) (aimdo)"
    assert _Driver.opened == 1


def test_budget_without_the_vendor_bindings_is_a_typed_error(fake_aimdo, monkeypatch):
    import membackend._backends.aimdo as aimdo

    def missing(kind):
        raise ImportError("No module named 'cuda'")

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(aimdo, "open_gpu_driver", missing)
    with pytest.raises(DriverError, match="No module named 'cuda'"):
        AimdoBackend().membackend_budget_query(device=CUDA0)
