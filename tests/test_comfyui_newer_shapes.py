"""Newer ComfyUI (0.38, 0.39): the calls into comfy-aimdo whose shape differs from the 0.33.0 tree, driven through
membackend's adapter (issue 43, item 5). No 0.38 or 0.39 tree runs here: each shape is described in this file's
own code from the public source, read one file at a time (Comfy-Org/ComfyUI, each at the one commit stored; the
commits carry no version tag, and the requirements read pin comfy-aimdo 0.5.5, as ComfyUI 0.38 does):

* ``comfy/model_patcher.py`` @08d0e510f4e5: ``ModelPatcherDynamic(model, load_device, offload_device, size=0,
  weight_inplace_update=False, fast_disk=False)`` (also ``ModelPatcher``'s sixth parameter, which the CPU reroute
  and the legacy patcher take); ``register_load_device`` makes six ``HostBuffer(0, 0, 0)`` pin subsets -- ``weights``,
  ``patches``, their ``-loaded`` and ``-fast`` twins -- and stores the model's ``fast_disk`` beside them;
  ``load`` makes the six for real (``HostBuffer(0, 64 MiB or 8 MiB, pinned_hostbuf_size)``); ``partially_unload_ram``
  pops the fast subsets first, each pin with ``truncate(offset, do_unregister=<registered>)``.
* ``comfy/model_management.py`` @02b2b3886164: ``FAST_PIN_SUBSETS``; registration pressure *destroys* fast pins
  (``partially_unload_ram``) where it only unregisters the others in place (``cudaHostUnregister``, memory kept);
  ``pin_memory(tensor, evict_active=True)`` calls ``ensure_pin_registerable(size, evict_active=...)`` first and
  gives up when it refuses; ``reset_cast_buffers`` empties the three patch subsets at the end of a prompt and
  makes a new ``HostBuffer(0, 8 MiB, ...)`` for each.
* ``comfy/pinned_memory.py`` @40bf8f7bab94: ``pin_memory(module, subset)`` extends the subset's buffer with
  ``register=False`` and page-locks the pin itself (``cudaHostRegister``), ``evict_active=not fast``.
* ``comfy/ops.py`` @0271a469fe29: the flag is per model (``s._pin_state["fast_disk"]``, no longer
  ``args.fast_disk``); a fast-disk model reads a weight whose VBAR range faulted straight from the file into the
  range (``read_file_to_device``), no pin; ``comfy/model_prefetch.py`` @03fb330a7f50 skips
  ``ensure_pin_registerable`` for it.
* ``comfy/storage.py`` @2d656ace126d: ``state_dict_fast_disk`` decides the flag per model (Linux: sysfs; Windows:
  ``comfy_aimdo.storage.fast_disk``, left to aimdo: ``wiring.LEFT_TO_AIMDO``).

membackend patches none of the pin functions: page-locking stays ComfyUI's, and the buffers' ``truncate`` and end
unregister what ComfyUI locked (``tests/test_comfyui_host_pins.py``). These tests pin that for the newer shapes,
and the one thing the newer shapes exposed: a truncated buffer gives the cut pages back, as aimdo's does
(comfy-aimdo ``src/hostbuf.c`` ``hostbuf_truncate_impl`` decommits them), so ComfyUI's pin eviction under RAM
pressure frees RAM.
"""

from __future__ import annotations

import ctypes
import inspect
import mmap
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("comfy_aimdo")

from test_comfyui_startup import comfy_args, originals, serve_cpu  # noqa: E402,F401  (the adapter's fixtures)

from membackend._comfyui import buffers, startup, wiring  # noqa: E402
from membackend._comfyui import vbar as facade  # noqa: E402

MiB = 1 << 20
SUBSETS = ("weights", "patches", "weights-loaded", "patches-loaded", "weights-fast", "patches-fast")
FAST = ("weights-fast", "patches-fast")
PATCHES = ("patches", "patches-loaded", "patches-fast")
PAGE = mmap.PAGESIZE


# --------------------------------------------------------------------------- the 0.39 pin state, in our words


class PinState:
    """One model's ``dynamic_pins[device]`` as ComfyUI 0.39 keeps it: per subset a HostBuffer and the stack of
    pins cut from it (offset, registered), and the model's ``fast_disk`` flag. ``rt`` is the adapter whose
    simulated driver page-locks for ComfyUI (``cudaHostRegister`` is the driver's ``cuMemHostRegister``)."""

    def __init__(self, rt, fast_disk: bool = False):
        self.rt = rt
        self.fast_disk = fast_disk
        # register_load_device: six empty buffers before the first load
        self.buffers = {s: buffers.HostBuffer(0, 0, 0) for s in SUBSETS}
        self.stacks: dict[str, list[list]] = {s: [] for s in SUBSETS}

    def initialize(self, hostbuf_size: int) -> None:
        """ModelPatcherDynamic.load, once: each subset's buffer made for real."""
        for s in SUBSETS:
            self.buffers[s] = buffers.HostBuffer(0, (8 if s.startswith("patches") else 64) * MiB, hostbuf_size)

    def _driver(self):
        return self.rt.session.backend.driver

    def _lock(self, address: int, size: int) -> None:
        driver = self._driver()
        with driver.on_device(0):
            assert driver.m.cuMemHostRegister(address, size, 1)[0] == driver.SUCCESS

    def pin(self, subset: str, size: int, fill: int = 0) -> int:
        """pinned_memory.pin_memory: extend with register=False, cut the pin at the extension, lock it."""
        hb = self.buffers[subset]
        offset = hb.size
        address = hb.extend(size=size, register=False)
        assert address == hb.get_raw_address() + offset
        if fill:
            ctypes.memset(address, fill, size)
        self._lock(address, size)
        self.stacks[subset].append([offset, True])
        return address

    def unregister_in_place(self, subset: str) -> None:
        """ModelPatcherDynamic.unregister_inactive_pins: ComfyUI's own cudaHostUnregister; the pin stays."""
        hb = self.buffers[subset]
        driver = self._driver()
        for entry in reversed(self.stacks[subset]):
            if entry[1]:
                with driver.on_device(0):
                    assert driver.m.cuMemHostUnregister(hb.get_raw_address() + entry[0])[0] == driver.SUCCESS
                entry[1] = False

    def reregister(self, subset: str, size: int) -> None:
        """pinned_memory.get_pin: a pin found unregistered is locked again at the same address."""
        hb = self.buffers[subset]
        for entry in self.stacks[subset]:
            if not entry[1]:
                self._lock(hb.get_raw_address() + entry[0], size)
                entry[1] = True

    def destroy(self, subsets=SUBSETS) -> None:
        """ModelPatcherDynamic.partially_unload_ram: each pin popped, its buffer cut at its offset."""
        for s in subsets:
            while self.stacks[s]:
                offset, registered = self.stacks[s].pop()
                self.buffers[s].truncate(offset, do_unregister=registered)

    def reset_patches(self, hostbuf_size: int) -> None:
        """model_management.reset_cast_buffers, at the end of a prompt: the three patch subsets emptied and made
        anew (the old buffers are dropped)."""
        self.destroy(PATCHES)
        for s in PATCHES:
            self.buffers[s] = buffers.HostBuffer(0, 8 * MiB, hostbuf_size)

    def registered(self) -> dict[str, set[int]]:
        """Per subset, the driver's registrations inside its buffer's mapping."""
        books = self._driver().m.platform.host_registered
        out = {}
        for s, hb in self.buffers.items():
            base = hb.get_raw_address()
            out[s] = {a for a in books if base <= a < base + hb._capacity}
        return out

    def close(self) -> None:
        for hb in self.buffers.values():
            hb.close()


@pytest.fixture
def rt(h200_adapter):
    """A started adapter on the simulated H200, whose driver keeps the registrations' books as CUDA's does."""
    return h200_adapter


def _books(rt) -> dict[int, int]:
    return dict(rt.session.backend.driver.m.platform.host_registered)


# --------------------------------------------------------------------------- six subsets


def test_six_pin_subsets_get_six_buffers_whose_pins_stay_apart(rt):
    """``comfy/model_patcher.py`` @08d0e510 (0.38/0.39): six ``HostBuffer(0, 0, 0)`` per device, then six sized
    ones at the first load; ``comfy/pinned_memory.py`` @40bf8f7b cuts and locks pins in each, ``-fast`` ones
    included. Every pin is its own registration inside its own subset's mapping."""
    state = PinState(rt, fast_disk=True)
    assert len({hb.get_raw_address() for hb in state.buffers.values()}) == len(SUBSETS)
    state.initialize(64 * MiB)
    for s in SUBSETS:
        for _ in range(2):
            state.pin(s, 4 * MiB)
    got = state.registered()
    assert all(len(got[s]) == 2 for s in SUBSETS), got
    assert len(_books(rt)) == 2 * len(SUBSETS)
    state.destroy()
    assert _books(rt) == {}
    state.close()


def test_registration_pressure_destroys_fast_pins_and_only_unlocks_the_others(rt):
    """``comfy/model_management.py`` @02b2b388 ``registration_eviction_tiers``: the fast subsets' pins are
    destroyed (``partially_unload_ram``: ``truncate(offset, do_unregister=True)``), the others unlocked in place
    by ComfyUI itself (``unregister_inactive_pins``) and locked again at the same address when next used
    (``get_pin``). The driver's books follow each step; an unlocked pin keeps its bytes."""
    state = PinState(rt)
    state.initialize(64 * MiB)
    weights = state.pin("weights", 4 * MiB, fill=0x5A)
    for s in FAST:
        state.pin(s, 4 * MiB)
    state.destroy(FAST)  # tier 1: fast pins of inactive models go
    assert state.registered()["weights-fast"] == state.registered()["patches-fast"] == set()
    assert set(_books(rt)) == {weights}
    state.unregister_in_place("weights")  # tier 2: the others unlocked, kept
    assert _books(rt) == {}
    assert ctypes.string_at(weights, 16) == b"\x5a" * 16
    state.reregister("weights", 4 * MiB)  # next use: locked again where it was
    assert set(_books(rt)) == {weights}
    state.unregister_in_place("weights")
    state.destroy(("weights",))  # registered False: truncate(do_unregister=False) leaves the driver alone
    assert _books(rt) == {}
    state.close()


def test_at_a_prompts_end_the_three_patch_subsets_start_anew_and_the_weights_keep_their_pins(rt):
    """``comfy/model_management.py`` @02b2b388 ``reset_cast_buffers``: ``patches``, ``patches-loaded`` and
    ``patches-fast`` are emptied (each pin cut with ``do_unregister=True``) and replaced by new buffers, which
    take pins as the old did; the weights' subsets keep theirs."""
    state = PinState(rt)
    state.initialize(64 * MiB)
    kept = {s: state.pin(s, 4 * MiB) for s in ("weights", "weights-loaded", "weights-fast")}
    old = {s: state.buffers[s] for s in PATCHES}
    for s in PATCHES:
        state.pin(s, 2 * MiB)
        state.pin(s, 2 * MiB)
    assert len(_books(rt)) == 3 + 2 * len(PATCHES)
    state.reset_patches(64 * MiB)
    assert set(_books(rt)) == set(kept.values())
    for hb in old.values():
        hb.close()  # ComfyUI's last reference goes (aimdo's hostbuf_free): nothing left to end
    assert set(_books(rt)) == set(kept.values())
    for s in PATCHES:  # the new buffers take pins as the old did
        state.pin(s, 2 * MiB)
    assert all(len(v) == 1 for v in state.registered().values())
    state.destroy()
    state.close()


def test_a_truncated_buffer_gives_the_cut_pages_back(rt):
    """ComfyUI destroys pins to relieve RAM (``ensure_pin_budget`` -> ``free_pins`` -> ``partially_unload_ram``,
    the fast subsets first in 0.39) and counts their size as freed; comfy-aimdo's ``hostbuf_truncate``
    decommits the pages past the cut. membackend's buffer must give them back too, else the pressure never
    eases and ComfyUI evicts every pin for nothing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("pages are given back with MADV_REMOVE, and counted in /proc/self/smaps: Linux only")
    state = PinState(rt)
    state.initialize(64 * MiB)
    hb = state.buffers["weights-fast"]
    for fill in (1, 2, 3, 4):
        state.pin("weights-fast", 8 * MiB, fill=fill)
    assert _resident(hb) >= 32 * MiB
    state.destroy(("weights-fast",))
    assert _resident(hb) < PAGE * 4, _resident(hb)
    again = state.pin("weights-fast", 8 * MiB)  # the same addresses serve the next pin, as new memory
    assert ctypes.string_at(again + 8 * MiB - 16, 16) == b"\0" * 16
    state.destroy()
    state.close()


def test_a_cut_inside_a_page_keeps_that_page_and_the_pins_below():
    """Only whole pages past the cut go: the pin below it keeps every byte."""
    if not hasattr(mmap, "MADV_REMOVE"):
        pytest.skip("no MADV_REMOVE here: the cut pages stay until the buffer's end")
    hb = buffers.HostBuffer(0, 0, 4 * MiB)
    low = hb.extend(PAGE + 100, register=False)
    ctypes.memset(low, 7, PAGE + 100)
    high = hb.extend(2 * PAGE, register=False)
    ctypes.memset(high, 9, 2 * PAGE)
    hb.truncate(PAGE + 100, do_unregister=False)
    assert ctypes.string_at(low, PAGE + 100) == b"\7" * (PAGE + 100)
    assert ctypes.string_at(high, PAGE - 100) == b"\x09" * (PAGE - 100)  # same page as the cut: kept
    assert ctypes.string_at(high + 2 * PAGE - 100, 100) == b"\0" * 100  # a whole page past it: given back
    hb.close()


def _resident(hb) -> int:
    """Bytes of the buffer's mapping resident now (``Rss`` of its ``/proc/self/smaps`` entry)."""
    start = f"{hb.get_raw_address():x}-"
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(start):
            for entry in lines[i + 1:i + 30]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1]) * 1024
    raise AssertionError("the buffer's mapping is not in /proc/self/smaps")


# --------------------------------------------------------------------------- the per-model fast-disk flag


def test_a_fast_disk_model_reads_straight_into_its_vbar_beside_a_pinned_one(rt, tmp_path):
    """``comfy/ops.py`` @0271a469 (0.39): the flag is per model. A fast-disk model's faulted range is read from
    the file into the VBAR with ``read_file_to_device(..., mark_cold=False)`` and no pin; a model on a slow disk,
    in the same process, reads through a locked pin of its ``weights`` subset (``HostBuffer.read_file_slice``
    with the device pointer). Both ranges hold the file's bytes; only the slow model locks host memory."""
    data = bytes(range(256)) * (4 * MiB // 256)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    fast, slow = PinState(rt, fast_disk=True), PinState(rt, fast_disk=False)
    for state in (fast, slow):
        state.initialize(16 * MiB)
    with open(path, "rb") as f:
        for state in (fast, slow):
            vbar = facade.ModelVBAR(8 * MiB, 0)
            alloc = vbar.alloc(len(data))
            assert facade.vbar_fault(alloc) is not None
            dest = facade.aimdo_to_tensor(alloc, "cpu")
            if state.fast_disk:
                buffers.read_file_to_device(f, 0, len(data), 0, alloc[1], 0, mark_cold=False)
            else:
                hb = state.buffers["weights"]
                pin = state.pin("weights", len(data))
                hb.read_file_slice(f, 0, len(data), offset=pin - hb.get_raw_address(), stream=0,
                                   device_ptr=alloc[1], device=0)
            assert bytes(dest.numpy()) == data
            facade.vbar_unpin(alloc)
            vbar.close()
    assert all(hb.size == 0 for hb in fast.buffers.values())
    assert set(_books(rt)) == slow.registered()["weights"] and len(_books(rt)) == 1
    for state in (fast, slow):
        state.destroy()
        state.close()


# --------------------------------------------------------------------------- the patched paths, 0.39's signatures


class _Patcher:
    """``comfy/model_patcher.py`` @08d0e510 ``ModelPatcher``: its sixth parameter is ``fast_disk``."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False, fast_disk=False):
        self.model, self.load_device, self.offload_device = model, load_device, offload_device
        self.fast_disk = fast_disk
        self.loads: list = []

    def is_dynamic(self):
        return False


class _Dynamic(_Patcher):
    """``ModelPatcherDynamic`` of the same file: the same parameters, a plain patcher for a CPU device, the flag
    beside the six pin subsets (the buffers themselves are the tests above)."""

    def __new__(cls, model=None, load_device=None, offload_device=None, size=0, weight_inplace_update=False,
                fast_disk=False):
        if getattr(load_device, "type", load_device) == "cpu":
            return _Patcher(model, load_device, offload_device, size, weight_inplace_update, fast_disk)
        return super().__new__(cls)

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False, fast_disk=False):
        super().__init__(model, load_device, offload_device, size, weight_inplace_update, fast_disk)
        self.model.dynamic_vbars = getattr(self.model, "dynamic_vbars", {})
        self.model.dynamic_pins = {load_device: {"fast_disk": self.fast_disk}}

    def is_dynamic(self):
        return True

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, dirty=False):
        self.loads.append((device_to, self.model.dynamic_pins[self.load_device]["fast_disk"]))

    def get_non_dynamic_delegate(self):
        return _Patcher(self.model, self.load_device, self.offload_device, fast_disk=self.fast_disk)


def _model_management(calls):
    """``comfy/model_management.py`` @02b2b388: the pin functions with their 0.39 parameters (each records its
    call), and the names membackend's patch points replace."""
    mm = types.ModuleType("comfy.model_management")
    mm.MAX_PINNED_MEMORY, mm.TOTAL_PINNED_MEMORY = 64 << 30, 0
    mm.PIN_SUBSETS, mm.LOADED_PIN_SUBSETS, mm.FAST_PIN_SUBSETS = list(SUBSETS[:2]), list(SUBSETS[2:4]), list(FAST)

    def free_registrations(shortfall, evict_active=True):
        calls.append(("free_registrations", shortfall, evict_active))
        return True

    def ensure_pin_registerable(size, evict_active=True):
        calls.append(("ensure_pin_registerable", size, evict_active))
        return mm.free_registrations(mm.TOTAL_PINNED_MEMORY + size - mm.MAX_PINNED_MEMORY, evict_active=evict_active)

    def pin_memory(tensor, evict_active=True):
        if mm.MAX_PINNED_MEMORY <= 0 or not mm.ensure_pin_registerable(tensor.nbytes, evict_active=evict_active):
            return False
        calls.append(("cudaHostRegister", tensor.nbytes))
        return True

    mm.free_registrations, mm.ensure_pin_registerable, mm.pin_memory = (free_registrations, ensure_pin_registerable,
                                                                         pin_memory)
    mm.get_free_memory = lambda dev=None, torch_free_too=False: 0
    mm.get_total_memory = lambda dev=None, torch_total_too=False: 0
    mm.free_memory = lambda memory_required, device, keep_loaded=[], *a, **k: []
    mm.current_loaded_models = []
    mm.load_models_gpu = lambda models, *a, **k: None
    return mm


@pytest.mark.usefixtures("comfy_args", "originals", "serve_cpu")
def test_pin_registration_stays_comfyuis_and_the_patched_paths_take_a_fast_disk_patcher(monkeypatch):
    """0.39's ``pin_memory(tensor, evict_active=True)``, ``ensure_pin_registerable`` and ``free_registrations``
    are ComfyUI's own after membackend starts (nothing wraps them; each is called with its own arguments), and a
    patcher built the way ``comfy/sd.py``'s loaders build one (``CoreModelPatcher(..., fast_disk=...)``) goes
    through membackend's ``ModelPatcherDynamic.load`` and ``get_non_dynamic_delegate`` with its flag intact."""
    import torch

    calls: list = []
    mm = _model_management(calls)
    mp = types.SimpleNamespace(ModelPatcher=_Patcher, ModelPatcherDynamic=_Dynamic, CoreModelPatcher=_Dynamic)
    theirs = {n: getattr(mm, n) for n in ("pin_memory", "ensure_pin_registerable", "free_registrations")}
    rt = _start(monkeypatch, mm, mp)
    try:
        assert {n: getattr(mm, n) for n in theirs} == theirs
        assert mm.pin_memory(torch.zeros(1024, dtype=torch.uint8), evict_active=False) is True
        assert calls[:2] == [("ensure_pin_registerable", 1024, False),
                             ("free_registrations", 1024 - (64 << 30), False)]
        model = torch.nn.Linear(4, 4)
        patcher = mp.CoreModelPatcher(model, load_device=torch.device("cuda", 0),
                                      offload_device="cpu", fast_disk=True)
        assert hasattr(_Dynamic.load, "_membackend") and hasattr(_Dynamic.get_non_dynamic_delegate, "_membackend")
        patcher.load(patcher.load_device, dirty=True)
        assert patcher.loads == [(patcher.load_device, True)]
        assert patcher.get_non_dynamic_delegate().fast_disk is True
        assert rt.aborted is None
        rt.abort(RuntimeError("test"), "a test switching membackend off")
        # what ComfyUI's loaders build next is its legacy patcher, which takes the same keyword
        assert mp.CoreModelPatcher is _Patcher
        assert mp.CoreModelPatcher(model, load_device="cuda:0", offload_device="cpu", fast_disk=True).fast_disk
    finally:
        rt.stop()
    assert {n: getattr(mm, n) for n in theirs} == theirs


def _start(monkeypatch, mm, mp):
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.model_patcher", mp)
    monkeypatch.delitem(sys.modules, "execution", raising=False)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    import comfy_aimdo.control as control

    monkeypatch.setattr(control, "lib", None)
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    return rt


#: every call into comfy-aimdo read in the newer files whose shape matters to what answers it, as
#: (name, positional arguments, keyword names, where it was read)
NEWER_CALLS = (
    ("comfy_aimdo.host_buffer.HostBuffer", 3, (), "model_patcher.py@08d0e510 register_load_device, load; "
                                                  "model_management.py@02b2b388 reset_cast_buffers"),
    ("comfy_aimdo.host_buffer.HostBuffer.extend", 0, ("size", "register"), "pinned_memory.py@40bf8f7b pin_memory"),
    ("comfy_aimdo.host_buffer.HostBuffer.truncate", 1, ("do_unregister",),
     "pinned_memory.py@40bf8f7b pin_memory; model_patcher.py@08d0e510 partially_unload_ram"),
    ("comfy_aimdo.model_vbar.ModelVBAR", 2, (), "model_patcher.py@08d0e510 _vbar_get"),
    ("comfy_aimdo.model_vbar.ModelVBAR.alloc", 1, (), "model_patcher.py@08d0e510 load"),
    ("comfy_aimdo.model_vbar.ModelVBAR.prioritize", 0, (), "model_patcher.py@08d0e510 load"),
    ("comfy_aimdo.model_vbar.ModelVBAR.free_memory", 1, (), "model_patcher.py@08d0e510 partially_unload"),
    ("comfy_aimdo.model_vbar.ModelVBAR.loaded_size", 0, (), "model_patcher.py@08d0e510 loaded_size"),
    ("comfy_aimdo.model_vbar.vbar_unpin", 1, (), "model_patcher.py@08d0e510 load; model_prefetch.py@03fb330a"),
    ("comfy_aimdo.model_vbar.vbar_fault", 1, (), "ops.py@0271a469 cast_modules_with_vbar; model_prefetch.py"),
    ("comfy_aimdo.model_vbar.vbar_signature_compare", 2, (), "ops.py@0271a469; model_prefetch.py@03fb330a"),
    ("comfy_aimdo.torch.aimdo_to_tensor", 2, (), "ops.py@0271a469 cast_modules_with_vbar"),
    ("comfy_aimdo.vram_buffer.VRAMBuffer", 2, (), "model_management.py@02b2b388 get_aimdo_cast_buffer"),
    ("comfy_aimdo.vram_buffer.VRAMBuffer.get", 2, (), "ops.py@0271a469 get_cast_buffer"),
)


@pytest.mark.parametrize("name, positional, keywords, where", NEWER_CALLS, ids=[c[0] for c in NEWER_CALLS])
def test_each_call_read_in_the_newer_sources_binds_to_what_serves_it(name, positional, keywords, where):
    """What serves each comfy-aimdo name the newer files call accepts that call's shape (a signature check like
    ``tests/test_comfyui_aimdo_calls.py``'s, which needs a tree on disk; the source is named per case)."""
    served = wiring.served()
    top = ".".join(name.split(".")[:3])
    member = name.split(".")[3] if name.count(".") > 2 else None
    ours = served[top]
    fn = getattr(ours, member) if member else (ours.__init__ if inspect.isclass(ours) else ours)
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    sig = inspect.Signature(params)
    sig.bind(*range(positional), **{k: None for k in keywords})  # raises TypeError naming what it refuses


def test_the_newer_windows_disk_query_is_left_to_aimdo_with_its_reason():
    """``comfy/storage.py`` @2d656ace ``fast_storage`` imports ``comfy_aimdo.storage.fast_disk`` on Windows only;
    it asks the disk's driver, no GPU: left to comfy-aimdo, with the reason in the table."""
    assert "comfy_aimdo.storage.fast_disk" in wiring.LEFT_TO_AIMDO
    assert "comfy_aimdo.storage.fast_disk" not in wiring.served()
