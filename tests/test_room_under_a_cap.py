"""A cap means what the user set (issue 34, item 3): under a headroom, what the process may hold on the
device is ``total - headroom``; the process's other use (its context, its runtime allocator) measured by the
driver comes off that room once, and the weights get the rest. The simulated drivers model a process's own
allocations beside membackend's, so this runs on every profile."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from membackend.lab import simulated_profiles, simulated_session

MiB = 1 << 20
FLAGS = "comfyui --reserve-vram/--vram-headroom"


def _vmm_profiles() -> tuple[str, ...]:
    return simulated_profiles(vmm_only=True)


@pytest.mark.parametrize("profile", _vmm_profiles())
def test_the_process_own_allocations_count_as_the_driver_counts_them(profile):
    s = simulated_session(profile)
    dev = s.devices()[0]
    sim = s.backend.driver.sim
    before = s.budget_query(dev)
    alloc = sim.process_alloc(dev.index, 64 * MiB)
    after = s.budget_query(dev)
    assert after.free <= before.free - 64 * MiB + 2 * MiB, (before, after)  # the pool may move by page cache
    assert sim.process_bytes(dev.index) == 64 * MiB
    split = s.room_split(dev)
    assert split is not None and split.other >= 64 * MiB and split.held == 0
    sim.process_free(alloc)
    assert sim.process_bytes() == 0
    s.close()


@pytest.mark.parametrize("profile", _vmm_profiles())
def test_under_a_reserve_the_weights_get_the_room_less_the_process_other_use(profile):
    s = simulated_session(profile)
    dev = s.devices()[0]
    sim = s.backend.driver.sim
    sim.process_alloc(dev.index, 96 * MiB)  # the process's context and allocator, beside membackend
    base = s.room_split(dev)
    room = base.other + 160 * MiB  # the flag leaves 160 MiB beyond the process's other use
    s.set_headroom(dev, base.total - room, source=FLAGS)
    split = s.room_split(dev)
    assert split.room == room and split.other == base.other
    assert split.weights_room == room - split.other == 160 * MiB  # counted once, not twice
    b = s.budget_query(dev)
    assert b.usable == split.weights_room - split.held
    r = s.reserve(dev, 512 * MiB)
    ps = r.page_size
    fitting = split.weights_room // ps * ps
    assert s.fault(r, 0, fitting).ok
    after = s.room_split(dev)
    assert after.resident == fitting and after.other == split.other
    # everything the process holds stays within the room the flag leaves, measured by the driver
    assert after.total - after.free <= after.room
    assert s.budget_query(dev).usable < ps
    s.free(r)
    s.release_reservation(r)
    s.close()


def test_the_split_counts_kept_handles_as_membackends_not_as_other_use():
    from membackend.types import Capabilities

    s = simulated_session("h200", capabilities=Capabilities(recycle_handles=True, recycle_limit=None))
    dev = s.devices()[0]
    r = s.reserve(dev, 64 * MiB)
    assert s.fault(r, 0, 64 * MiB).ok
    s.free(r)
    split = s.room_split(dev)
    assert split.resident == 0 and split.held == 64 * MiB and split.other == 0
    s.release_reservation(r)
    s.close()


def test_comfyuis_get_free_memory_does_not_change_with_its_own_flags(monkeypatch):
    """Stock's get_free_memory does not move with --reserve-vram or --vram-headroom (ComfyUI accounts for
    them itself, comfy-aimdo bounds its weights by them); membackend's answered the budget less them, so
    ComfyUI took other paths (cond batching, attention slicing) and images differed from stock's."""
    s = simulated_session("h200")
    dev = s.devices()[0]
    s.backend.driver.sim.process_alloc(dev.index, 800 * MiB)
    plain = s.free_for_host(dev)
    assert plain == s.budget_query(dev).usable  # no flag: the budget, as before
    total = s.budget_query(dev).total
    s.set_headroom(dev, total - 922 * MiB, source=FLAGS)
    assert s.free_for_host(dev) == plain
    assert s.budget_query(dev).usable < 200 * MiB  # the weights still keep the flag
    s.set_headroom(dev, 4 << 30, source="live")  # membackend's own cap is still subtracted
    assert s.free_for_host(dev) == s.budget_query(dev).usable
    s.close()


def test_stream_through_a_cap_counts_driver_calls():
    """A model larger than the weights' room, faulted and unpinned front to back, step after step: the figures
    of the closing note (what each warm step costs in driver calls)."""
    from membackend._residency import ResidencyManager

    s = simulated_session("h200")
    dev = s.devices()[0]
    sim = s.backend.driver.sim
    sim.process_alloc(dev.index, 600 * MiB)
    total = s.budget_query(dev).total
    s.set_headroom(dev, total - 922 * MiB, source=FLAGS)
    rm = ResidencyManager(s)
    size, chunk = 800 * MiB, 8 * MiB
    m = rm.register("unet", size, [dev])
    rm.use([m])
    for _ in range(2):
        for off in range(0, size, chunk):
            if rm.fault(m, off, chunk, dev).ok:
                rm.unpin(m, off, chunk, dev)
            split = s.room_split(dev)
            assert split.total - split.free <= split.room  # within the room at every fault
    s.close()


def test_the_adapter_answers_comfyui_the_same_free_memory_with_and_without_reserve_vram(monkeypatch):
    """Through the real adapter on simulated h200: ComfyUI's patched get_free_memory under --reserve-vram
    leaving 0.9 GiB answers what it answers without the flag, while the status shows the split and the
    weights' budget keeps the flag."""
    pytest.importorskip("comfy_aimdo")
    from membackend._comfyui import startup, status

    answers = {}
    for reserve in (None, "cap"):
        args = argparse.Namespace(cpu=False, highvram=False, gpu_only=False, novram=False, lowvram=False,
                                  disable_dynamic_vram=False, enable_dynamic_vram=False, disable_cuda_graphs=False,
                                  disable_smart_memory=False, reserve_vram=None, vram_headroom=0)
        monkeypatch.setitem(sys.modules, "comfy.cli_args",
                            types.SimpleNamespace(args=args, enables_dynamic_vram=lambda: True))
        mm = types.ModuleType("comfy.model_management")
        mm.get_free_memory = lambda dev=None, torch_free_too=False: 0  # type: ignore[attr-defined]
        cuda0 = types.SimpleNamespace(type="cuda", index=0)  # a torch.device's two attributes
        mm.get_torch_device = lambda: cuda0  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
        monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
        monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "h200")
        if reserve:
            from membackend.lab import simulated_driver
            total = simulated_driver("h200").budget("device", 0)[0]
            args.reserve_vram = (total - 922 * MiB) / 1024 ** 3  # GB kept free of the card: 922 MiB left
        rt = startup.prestartup()
        try:
            assert rt.init_devices([(0, 0)]) is True, rt.aborted
            rt.session.backend.driver.sim.process_alloc(0, 800 * MiB)  # the process's context and allocator
            answers[reserve] = mm.get_free_memory(cuda0)
            budget = status.runtime_status(rt)["budgets"]["cuda:0"]
            split = budget["split"]
            if reserve:
                assert split["room"] == 922 * MiB and split["other"] == 800 * MiB
                assert split["weights_room"] == 122 * MiB and budget["usable"] == 122 * MiB
        finally:
            rt.stop()
    assert answers[None] == answers["cap"] > 100 << 30
