"""The prestartup decision and the init_devices hook, in process: one log line in every case, nothing
patched unless a non-aimdo backend is selected, and every patch undone on failure or stop."""

from __future__ import annotations

import argparse
import logging
import sys
import types

import pytest

pytest.importorskip("comfy_aimdo")

import comfy_aimdo.control as control  # noqa: E402
import comfy_aimdo.model_vbar as aimdo_vbar  # noqa: E402

from membackend._comfyui import startup, status, vbar  # noqa: E402
from membackend._comfyui.wiring import FACADE_NAMES  # noqa: E402

#: a machine with one CUDA device, whatever this one has (MEMBACKEND_MACHINE__DEVICES)
CUDA_DEVICE = '[{"kind": "cuda", "total_memory": "8GiB"}]'
FLAGS = dict(cpu=False, highvram=False, gpu_only=False, novram=False, lowvram=False, disable_dynamic_vram=False,
             enable_dynamic_vram=False, disable_cuda_graphs=False, disable_smart_memory=False, reserve_vram=None,
             vram_headroom=0)


@pytest.fixture
def comfy_args(monkeypatch):
    """ComfyUI's parsed arguments and its own rule, as comfy/cli_args.py has them."""
    args = argparse.Namespace(**FLAGS)

    def enables_dynamic_vram():  # comfy/cli_args.py, enables_dynamic_vram
        if args.enable_dynamic_vram:
            return True
        return not (args.disable_dynamic_vram or args.highvram or args.gpu_only or args.novram or args.cpu)
    monkeypatch.setitem(sys.modules, "comfy.cli_args",
                        types.SimpleNamespace(args=args, enables_dynamic_vram=enables_dynamic_vram))
    return args


@pytest.fixture
def serve_cpu(monkeypatch):
    """The host backend takes over as a GPU backend would (what the stand-in ComfyUI does)."""
    monkeypatch.setattr(startup, "SERVE_CPU_DEVICES", True)


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="membackend")

    def get():
        return [r.getMessage() for r in caplog.records if r.name == "membackend"]
    return get


@pytest.fixture
def originals():
    saved = (control.init_devices, {n: getattr(aimdo_vbar, n) for n in FACADE_NAMES}, control.set_log_info)
    yield saved
    rt = startup.current()
    if rt is not None:
        rt.stop()
    assert control.init_devices is saved[0] and control.set_log_info is saved[2]
    assert {n: getattr(aimdo_vbar, n) for n in FACADE_NAMES} == saved[1]


def _untouched(originals, args):
    assert control.init_devices is originals[0]
    assert not (args.disable_cuda_graphs or args.enable_dynamic_vram)
    assert startup.current() is None


def _one_short_line(lines):
    got = lines()
    assert len(got) == 1, got
    assert "\n" not in got[0] and len(got[0]) <= 200, got[0]
    return got[0]


@pytest.mark.parametrize("env, says, state", [
    ({"MEMBACKEND_DISABLE": "1"}, "off (MEMBACKEND_DISABLE=1); ComfyUI runs stock", "disabled"),
    ({"MEMBACKEND_BACKEND": "aimdo", "MEMBACKEND_MACHINE__DEVICES": CUDA_DEVICE},
     "ComfyUI runs stock with its own comfy-aimdo", "stock"),
    # a forced backend that serves no device of this machine is a configuration error, said in the line
    ({"MEMBACKEND_BACKEND": "vmm", "MEMBACKEND_MACHINE__DEVICES": "[]"},
     "not started (BackendNotFound: backend 'vmm' cannot be used here: it serves cuda devices", "not-started"),
    ({}, "ComfyUI runs stock: no GPU backend fits", "stock"),
    ({"MEMBACKEND_BACKEND": "host"}, "ComfyUI runs stock: host serves no GPU", "stock"),
    ({"MEMBACKEND_HEADROOM": "lots"}, "not started (ConfigError", "not-started"),
    ({"MEMBACKEND_BACKEND": "nosuch"}, "not started (BackendNotFound", "not-started"),
])
def test_where_membackend_cannot_serve_nothing_is_patched_and_one_short_line_says_why(
        monkeypatch, comfy_args, lines, originals, env, says, state):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert startup.prestartup() is None
    _untouched(originals, comfy_args)
    line = _one_short_line(lines)
    assert line.startswith("membackend ") and says in line, line
    assert "MEMBACKEND_DISABLE" in line
    got = status.status()
    assert got["running"] is False and got["state"] == state and got["line"] == line


@pytest.mark.parametrize("flag", ["cpu", "highvram", "gpu_only", "novram", "disable_dynamic_vram"])
def test_comfyuis_own_rule_wins_and_the_line_names_the_flag_as_typed(monkeypatch, comfy_args, lines, originals, flag):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "h200")  # a GPU backend would fit
    setattr(comfy_args, flag, True)
    assert startup.prestartup() is None
    setattr(comfy_args, flag, False)
    _untouched(originals, comfy_args)
    typed = "--" + flag.replace("_", "-")
    assert f"its dynamic VRAM is off ({typed})" in _one_short_line(lines)


@pytest.mark.parametrize("flags, on, why", [
    ({}, True, "ComfyUI's default"), ({"lowvram": True}, True, "ComfyUI's default"),
    ({"disable_smart_memory": True}, True, "ComfyUI's default"),
    ({"highvram": True}, False, "--highvram"), ({"gpu_only": True}, False, "--gpu-only"),
    ({"novram": True}, False, "--novram"), ({"cpu": True}, False, "--cpu"),
    ({"highvram": True, "enable_dynamic_vram": True}, True, "--enable-dynamic-vram"),
    ({"cpu": True, "enable_dynamic_vram": True}, True, "--enable-dynamic-vram"),
])
def test_comfy_dynamic_vram_answers_comfyuis_rule(comfy_args, flags, on, why):
    for k, v in flags.items():
        setattr(comfy_args, k, v)
    cli = sys.modules["comfy.cli_args"]
    assert startup.comfy_dynamic_vram(cli) == (on, why)
    assert startup.comfy_dynamic_vram(cli)[0] == cli.enables_dynamic_vram()


@pytest.mark.parametrize("profile, backend", [("h200", "vmm"), ("wddm-6gb", "cuda_wddm"),
                                              ("gb10-128gb", "unified_gb10"), ("rocm-win-2gpu", "rocm_windows"),
                                              ("strix-halo-128gb", "rocm_linux"), ("rx7900xtx-linux", "rocm_linux")])
def test_a_simulated_gpu_counts_as_served_even_under_cpu_with_forced_dynamic_vram(
        monkeypatch, comfy_args, lines, originals, profile, backend):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", profile)
    comfy_args.cpu = comfy_args.enable_dynamic_vram = True
    rt = startup.prestartup()
    assert rt is not None and rt.name == backend and control.init_devices == rt.init_devices
    line = _one_short_line(lines)
    assert f"using {backend} (" in line and f"simulated {profile}" in line and "MEMBACKEND_BACKEND=<name>" in line
    assert not comfy_args.disable_cuda_graphs  # armed only: nothing else changes until ComfyUI calls init_devices
    rt.stop()
    comfy_args.cpu = comfy_args.enable_dynamic_vram = False
    _untouched(originals, comfy_args)


def test_cpu_with_forced_dynamic_vram_on_real_facts_stays_stock(monkeypatch, comfy_args, lines, originals, serve_cpu):
    monkeypatch.setattr(startup, "SERVE_CPU_DEVICES", False)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", CUDA_DEVICE)  # vmm serves a device here; ComfyUI's is the CPU
    comfy_args.cpu = comfy_args.enable_dynamic_vram = True
    assert startup.prestartup() is None
    assert "its device is the CPU (--cpu)" in _one_short_line(lines)


def test_a_selected_backend_arms_the_hook_and_stop_undoes_every_patch(
        monkeypatch, comfy_args, lines, originals, serve_cpu):
    # a ComfyUI whose model_management has none of the wired names: each is skipped and reported
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.ModuleType("comfy.model_management"))
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    # aimdo's library not loaded, as in a process that never ran aimdo's init (a test of the drivers run
    # earlier in this process may have loaded it: the module keeps it)
    monkeypatch.setattr(control, "lib", None)
    rt = startup.prestartup()
    assert rt is startup.current() and control.init_devices == rt.init_devices
    assert not comfy_args.disable_cuda_graphs and not comfy_args.enable_dynamic_vram  # ComfyUI's own flag decides
    assert "using host (forced by MEMBACKEND_BACKEND)" in _one_short_line(lines)
    assert rt.init_devices((i, 0) for i in range(1)) is True
    assert comfy_args.disable_cuda_graphs  # CUDA-graph capture would record aimdo's own allocations
    assert "--disable-comfy-compiler" in rt.patches.skipped  # named as the flag a user types
    assert aimdo_vbar.ModelVBAR is vbar.ModelVBAR and startup.current() is rt and rt.running
    assert {"comfy.model_management.free_memory", "comfy.model_management.get_free_memory",
            "comfy.model_management.load_models_gpu"} <= set(rt.patches.skipped)
    # what main.py calls next: aimdo's log functions, whose library was never loaded here
    assert control.lib is None
    control.set_log_info()
    control.set_log_debug()
    assert rt.init_devices([0]) is True  # ComfyUI's TypeError retry: the same answer, nothing redone
    rt.stop()
    _untouched(originals, comfy_args)
    assert aimdo_vbar.ModelVBAR.__module__ == "comfy_aimdo.model_vbar" and startup.current() is None


@pytest.mark.parametrize("profile, pinning", [("strix-halo-128gb", 0), ("gb10-128gb", 0),
                                              ("rx7900xtx-linux", 8 << 30), ("h200", 8 << 30)])
def test_one_pool_turns_comfyuis_pinned_host_copies_off_and_stop_gives_them_back(
        monkeypatch, comfy_args, lines, originals, profile, pinning):
    mm = types.ModuleType("comfy.model_management")
    mm.MAX_PINNED_MEMORY = 8 << 30  # what ComfyUI sets on an NVIDIA or AMD machine (a share of the RAM)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", profile)
    comfy_args.cpu = comfy_args.enable_dynamic_vram = True
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    assert mm.MAX_PINNED_MEMORY == pinning
    assert ("one memory pool with the host: ComfyUI's pinned host copies of weights are off" in " ".join(lines())) \
        == (pinning == 0)
    rt.stop()
    assert mm.MAX_PINNED_MEMORY == 8 << 30


def _pin_as_comfyui_does(rt, mm, hostbuf, size: int) -> bool:
    """The part of ``comfy/pinned_memory.py``'s ``pin_memory`` that costs memory: the pin budget first
    (``ensure_pin_registerable``, which frees nothing and refuses while ``MAX_PINNED_MEMORY <= 0``), then the
    pin cut at the buffer's new extension page-locked by the driver (``cudaHostRegister``: the simulated
    ``cuMemHostRegister`` / ``hipHostRegister``) and counted in ``TOTAL_PINNED_MEMORY``."""
    if mm.MAX_PINNED_MEMORY <= 0 or mm.TOTAL_PINNED_MEMORY + size > mm.MAX_PINNED_MEMORY:
        return False
    start = hostbuf.extend(size, register=False)
    driver = rt.session.backend.driver
    lock = getattr(driver.m, "cuMemHostRegister", None) or driver.m.hipHostRegister
    with driver.on_device(0):
        assert lock(start, size, 1)[0] == driver.SUCCESS
    mm.TOTAL_PINNED_MEMORY += size
    return True


@pytest.mark.parametrize("profile, one_pool", [("gb10-128gb", True), ("strix-halo-128gb", True), ("h200", False)])
def test_host_buffers_of_8_gib_leave_a_one_pool_budget_as_it_was_and_the_status_shows_what_is_locked(
        monkeypatch, comfy_args, originals, profile, one_pool):
    """Issue 43, item 4: on one pool with the host, a page-locked byte is a byte the GPU's budget loses, so
    ComfyUI's pinning is off there and 8 GiB of pins lock nothing; on a card of its own (H200) they lock 8 GiB
    of host memory, shown per device in the status, and the card's budget does not move."""
    from membackend._comfyui.buffers import HostBuffer

    mm = types.ModuleType("comfy.model_management")
    mm.MAX_PINNED_MEMORY, mm.TOTAL_PINNED_MEMORY = 64 << 30, 0  # a share of the RAM, as ComfyUI sets it
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", profile)
    comfy_args.cpu = comfy_args.enable_dynamic_vram = True
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    device = rt.devices[0]
    before = rt.session.budget_query(device)
    hostbuf = HostBuffer(0, 0, 8 << 30)
    pinned = [_pin_as_comfyui_does(rt, mm, hostbuf, 256 << 20) for _ in range(32)]
    after = rt.session.budget_query(device)
    locked = status.runtime_status(rt)["host_locked"][str(device)]
    assert (before.free, before.usable) == (after.free, after.usable), (profile, before, after)
    assert locked["one_pool"] is one_pool and locked["bytes"] == (0 if one_pool else 8 << 30), locked
    assert all(pinned) is not one_pool and any(pinned) is not one_pool
    driver = rt.session.backend.driver
    if one_pool:  # what the guard keeps away: the same pins with ComfyUI's pinning left on take their size from
        # the one pool (on GB10 straight off the GPU's budget; Strix Halo's is bound by its 96 GiB GTT first)
        available = driver.m.platform.meminfo()["MemAvailable"]
        mm.MAX_PINNED_MEMORY = 64 << 30
        assert all(_pin_as_comfyui_does(rt, mm, hostbuf, 256 << 20) for _ in range(32))
        assert available - driver.m.platform.meminfo()["MemAvailable"] == 8 << 30
        lowered = rt.session.budget_query(device)
        assert before.free - lowered.free == (8 << 30 if profile == "gb10-128gb" else 0), (before, lowered)
    for address in list(driver.m.platform.host_registered):
        driver.m.platform.host_unregister(address)
    hostbuf.close()
    rt.stop()


def test_comfyuis_headroom_flags_reach_the_budget(monkeypatch, comfy_args, originals, serve_cpu):
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.ModuleType("comfy.model_management"))
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    monkeypatch.setenv("MEMBACKEND_HEADROOM", str(256 << 20))
    comfy_args.reserve_vram = 1.0  # GB kept free at least (the larger of it and the backend's own)
    rt = startup.prestartup()
    assert rt.init_devices([(0, 512 << 20)]) is True  # --vram-headroom 0.5: on top
    b = rt.session.budget_query(rt.devices[0])
    assert b.headroom == (1 << 30) + (512 << 20) and b.usable == max(0, b.free - b.headroom)
    assert status.runtime_status(rt)["budgets"][str(rt.devices[0])]["headroom"] == b.headroom
    rt.stop()


def test_a_failing_start_restores_everything_and_answers_with_the_original(
        monkeypatch, comfy_args, lines, originals, serve_cpu):
    calls = []

    def original(ids):
        calls.append(list(ids))
        return False
    monkeypatch.setattr(control, "init_devices", original)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    rt = startup.prestartup()
    from membackend._comfyui import wiring

    def broken(rt):
        raise RuntimeError("injected into the wiring")
    monkeypatch.setattr(wiring, "wire", broken)
    assert rt.init_devices(iter([(0, 0)])) is False
    assert calls == [[(0, 0)]]  # the generator was consumed once and handed on as a list
    assert control.init_devices is original and control.set_log_info is originals[2]
    assert {n: getattr(aimdo_vbar, n) for n in FACADE_NAMES} == originals[1]
    assert not comfy_args.disable_cuda_graphs and not rt.running
    assert rt.session is not None and rt.session.reservations() == []
    warn = [ln for ln in lines() if "switched off" in ln]
    assert len(warn) == 1 and "injected into the wiring" in warn[0] and "every original restored" in warn[0]
    assert status.status()["state"] == "switched-off"
    monkeypatch.setattr(control, "init_devices", originals[0])
    rt.stop()


class _Queue:
    """The two names of ComfyUI's execution.PromptQueue the idle patch uses."""

    def __init__(self):
        self.pending = 0
        self.done = []

    def task_done(self, item_id, history_result, status, process_item=None):
        self.done.append((item_id, process_item))

    def get_tasks_remaining(self):
        return self.pending


def test_the_idle_patch_calls_on_idle_only_when_the_queue_is_empty_and_stop_restores_it(
        monkeypatch, comfy_args, lines, originals, serve_cpu):
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.ModuleType("comfy.model_management"))
    monkeypatch.setitem(sys.modules, "execution", types.SimpleNamespace(PromptQueue=_Queue))
    original = _Queue.task_done
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    assert _Queue.task_done is not original and "execution.PromptQueue.task_done" not in rt.patches.skipped
    calls = []
    monkeypatch.setattr(rt.residency, "on_idle", lambda: calls.append("idle") or 0)
    q = _Queue()
    q.pending = 1  # another prompt still queued
    q.task_done(7, {}, None, process_item=len)
    assert q.done == [(7, len)] and calls == []
    q.pending = 0
    q.task_done(8, {}, None)
    assert q.done == [(7, len), (8, None)] and calls == ["idle"] and rt.journal.idles == 1
    assert status.runtime_status(rt)["idle"] == {"times": 1, "bytes": 0}
    rt.stop()
    assert _Queue.task_done is original


def test_without_a_prompt_queue_the_idle_patch_is_skipped_and_reported(monkeypatch, comfy_args, originals, serve_cpu):
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.ModuleType("comfy.model_management"))
    monkeypatch.delitem(sys.modules, "execution", raising=False)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    assert "execution.PromptQueue.task_done" in rt.patches.skipped


@pytest.mark.parametrize("env, absent", [
    ({"MEMBACKEND_BACKEND": "host"}, ["pydantic", "pydantic_settings"]),
    ({}, ["pydantic", "pydantic_settings", "membackend._residency", "membackend._comfyui.vbar"]),
    ({"MEMBACKEND_DISABLE": "1"}, ["pydantic", "membackend._manager", "membackend._machine"]),
])
def test_start_up_with_plain_settings_imports_no_pydantic_and_only_what_it_uses(tmp_path, env, absent):
    """What keeps the adapter's start-up cost down (benchmarks/bench_comfyui_startup.py measures it):
    pydantic is not imported for plain settings, the policy and the facade only when membackend starts,
    and nothing of the manager when membackend is off."""
    code = """if True:
        import json, sys, types
        sys.modules["comfy.model_management"] = types.ModuleType("comfy.model_management")
        from membackend._comfyui import startup
        startup.SERVE_CPU_DEVICES = True
        rt = startup.prestartup()
        if rt is not None:
            assert rt.init_devices([(0, 0)]), rt.aborted
        roots = ("pydantic", "pydantic_settings", "pluggy", "membackend")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in roots)))
    """
    import json
    import os
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    p = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    loaded = set(json.loads(p.stdout.strip().splitlines()[-1]))
    assert "membackend._comfyui.startup" in loaded
    assert not loaded & set(absent), loaded & set(absent)
    if env.get("MEMBACKEND_BACKEND") == "host":
        assert {"membackend._residency", "membackend._comfyui.vbar", "membackend._comfyui.wiring"} <= loaded

