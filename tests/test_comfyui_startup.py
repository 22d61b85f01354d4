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

from membackend.comfyui import startup, vbar  # noqa: E402


@pytest.fixture
def comfy_args(monkeypatch):
    args = argparse.Namespace(disable_comfy_compiler=False, disable_cuda_graphs=False, enable_dynamic_vram=False,
                              disable_dynamic_vram=False)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", types.SimpleNamespace(args=args))
    return args


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="membackend")

    def get():
        return [r.getMessage() for r in caplog.records if r.name == "membackend"]
    return get


@pytest.fixture
def originals():
    saved = (control.init_devices, {n: getattr(aimdo_vbar, n) for n in startup.FACADE_NAMES})
    yield saved
    rt = startup.current()
    if rt is not None:
        rt.stop()
    assert control.init_devices is saved[0]
    assert {n: getattr(aimdo_vbar, n) for n in startup.FACADE_NAMES} == saved[1]


def _untouched(originals, args):
    assert control.init_devices is originals[0]
    assert not (args.disable_comfy_compiler or args.disable_cuda_graphs or args.enable_dynamic_vram)
    assert startup.current() is None


@pytest.mark.parametrize("env, says", [
    ({"MEMBACKEND_DISABLE": "1"}, "off (MEMBACKEND_DISABLE is set)"),
    ({"MEMBACKEND_BACKEND": "aimdo"}, "backend aimdo"),
    ({}, "no accelerator backend fits"),
    ({"MEMBACKEND_HEADROOM": "lots"}, "not started (ConfigError"),
    ({"MEMBACKEND_BACKEND": "nosuch"}, "not started (BackendNotFound"),
])
def test_off_aimdo_no_gpu_and_bad_settings_patch_nothing_and_say_so_in_one_line(
        monkeypatch, comfy_args, lines, originals, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert startup.prestartup() is None
    _untouched(originals, comfy_args)
    got = lines()
    assert len(got) == 1 and says in got[0], got
    assert "MEMBACKEND_DISABLE=1" in got[0] or env.get("MEMBACKEND_DISABLE")


def test_comfyuis_own_disable_flag_wins(monkeypatch, comfy_args, lines, originals):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    comfy_args.disable_dynamic_vram = True
    assert startup.prestartup() is None
    comfy_args.disable_dynamic_vram = False
    _untouched(originals, comfy_args)
    assert len(lines()) == 1


def test_a_selected_backend_arms_the_hook_and_stop_undoes_every_patch(monkeypatch, comfy_args, lines, originals):
    # a ComfyUI whose model_management has none of the wired names: each is skipped and reported
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.ModuleType("comfy.model_management"))
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    rt = startup.prestartup()
    assert rt is startup.current() and control.init_devices == rt.init_devices
    assert comfy_args.disable_comfy_compiler and comfy_args.disable_cuda_graphs and comfy_args.enable_dynamic_vram
    assert len(lines()) == 1 and "backend host (forced" in lines()[0]
    assert rt.init_devices((i, 0) for i in range(1)) is True
    assert aimdo_vbar.ModelVBAR is vbar.ModelVBAR and vbar.get_runtime() is rt
    assert {"comfy.model_management.free_memory", "comfy.model_management.get_free_memory",
            "comfy.model_management.load_models_gpu"} <= set(rt.patches.skipped)
    assert rt.init_devices([0]) is True  # ComfyUI's TypeError retry: the same answer, nothing redone
    rt.stop()
    _untouched(originals, comfy_args)
    assert aimdo_vbar.ModelVBAR.__module__ == "comfy_aimdo.model_vbar" and vbar.get_runtime() is None


def test_a_failing_start_restores_everything_and_answers_with_the_original(monkeypatch, comfy_args, lines, originals):
    calls = []

    def original(ids):
        calls.append(list(ids))
        return False
    monkeypatch.setattr(control, "init_devices", original)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    rt = startup.prestartup()
    from membackend.comfyui import wiring

    def broken(rt):
        raise RuntimeError("injected into the wiring")
    monkeypatch.setattr(wiring, "wire", broken)
    assert rt.init_devices(iter([(0, 0)])) is False
    assert calls == [[(0, 0)]]  # the generator was consumed once and handed on as a list
    assert control.init_devices is original
    assert {n: getattr(aimdo_vbar, n) for n in startup.FACADE_NAMES} == originals[1]
    assert not comfy_args.enable_dynamic_vram and startup.current() is None and vbar.get_runtime() is None
    assert rt.session is not None and rt.session.reservations() == []
    warn = [ln for ln in lines() if "switched off" in ln]
    assert len(warn) == 1 and "injected into the wiring" in warn[0] and "every original restored" in warn[0]
    monkeypatch.setattr(control, "init_devices", originals[0])


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
        monkeypatch, comfy_args, lines, originals):
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
    assert q.done == [(7, len), (8, None)] and calls == ["idle"] and rt.idles == 1
    assert rt.status()["idle"] == {"times": 1, "bytes": 0}
    rt.stop()
    assert _Queue.task_done is original


def test_without_a_prompt_queue_the_idle_patch_is_skipped_and_reported(monkeypatch, comfy_args, originals):
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.ModuleType("comfy.model_management"))
    monkeypatch.delitem(sys.modules, "execution", raising=False)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    assert "execution.PromptQueue.task_done" in rt.patches.skipped


@pytest.mark.parametrize("env, absent", [
    ({"MEMBACKEND_BACKEND": "host"}, ["pydantic", "pydantic_settings"]),
    ({}, ["pydantic", "pydantic_settings", "membackend.residency", "membackend.comfyui.vbar"]),
    ({"MEMBACKEND_DISABLE": "1"}, ["pydantic", "membackend.manager", "membackend.machine"]),
])
def test_start_up_with_plain_settings_imports_no_pydantic_and_only_what_it_uses(tmp_path, env, absent):
    """What keeps the adapter's start-up cost down (benchmarks/bench_comfyui_startup.py measures it):
    pydantic is not imported for plain settings, the policy and the facade only when membackend starts,
    and nothing of the manager when membackend is off."""
    code = """if True:
        import json, sys, types
        sys.modules["comfy.model_management"] = types.ModuleType("comfy.model_management")
        from membackend.comfyui import startup
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
    assert "membackend.comfyui.startup" in loaded
    assert not loaded & set(absent), loaded & set(absent)
    if env.get("MEMBACKEND_BACKEND") == "host":
        assert {"membackend.residency", "membackend.comfyui.vbar", "membackend.comfyui.wiring"} <= loaded


# ---------------------------------------------------------------------------- the start-up measurement

from membackend.comfyui import startup_cost  # noqa: E402

ROWS = {"torch", "adapter, auto", "adapter, started", "torch, after prestartup"}


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="needs torch")
def test_measure_startup_runs_and_reports_every_side():
    """A real run (one round, no warm-up); shapes only, no timing threshold."""
    r = startup_cost.measure_startup(1, bytecode_cache=False)
    assert set(r["rows"]) == ROWS and r["rounds"] == 1 and r["bytecode_cache"] is False
    assert r["torch_seconds"] > 0 and r["adapter_seconds"] > 0
    assert r["adapter_seconds"] == max(r["rows"]["adapter, auto"]["seconds"], r["rows"]["adapter, started"]["seconds"])
    assert r["ratio"] == pytest.approx(r["adapter_seconds"] / r["torch_seconds"])
    assert "adapter, started" in startup_cost.format_startup(r)


def test_without_torch_it_raises_torch_missing(monkeypatch):
    real = startup_cost.importlib.util.find_spec
    monkeypatch.setattr(startup_cost.importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    with pytest.raises(startup_cost.TorchMissing, match="torch is not installed"):
        startup_cost.measure_startup(1)
    assert issubclass(startup_cost.TorchMissing, startup_cost.StartupCostError)


def test_a_side_that_did_not_start_or_failed_is_an_error_not_a_figure(monkeypatch):
    def not_started(code, extra, cwd, pycache):
        if code == startup_cost.TORCH:
            return {"seconds": 2.0}
        return {"seconds": 0.01, "torch_seconds": 2.0, "armed": False, "started": False, "aborted": None}
    monkeypatch.setattr(startup_cost, "_run", not_started)
    with pytest.raises(startup_cost.StartupCostError, match="did not start on the host backend"):
        startup_cost.measure_startup(1, bytecode_cache=False)
    monkeypatch.undo()
    monkeypatch.setattr(startup_cost, "ADAPTER", "raise SystemExit('broken adapter')")
    with pytest.raises(startup_cost.StartupCostError, match="broken adapter"):
        startup_cost.measure_startup(1, bytecode_cache=False)


def test_rounds_alternate_the_sides_and_keep_each_sides_best(monkeypatch):
    seen = []
    figures = iter([2.0, 0.3, 0.2, 1.5, 0.4, 0.1, 1.8, 0.1, 0.5])  # torch, auto, started per round

    def fake(code, extra, cwd, pycache):
        side = "torch" if code == startup_cost.TORCH else ("started" if extra else "auto")
        seen.append((side, pycache is not None))
        step = next(figures)
        return {"seconds": step, "torch_seconds": 3 * step, "armed": True, "started": True, "aborted": None}
    monkeypatch.setattr(startup_cost, "_run", fake)
    r = startup_cost.measure_startup(3, bytecode_cache=False)
    assert [s for s, _ in seen] == ["torch", "auto", "started"] * 3 and not any(c for _, c in seen)
    assert r["torch_seconds"] == 1.5 and r["rows"]["adapter, auto"]["seconds"] == 0.1
    assert r["rows"]["adapter, started"]["seconds"] == 0.1 and r["adapter_seconds"] == 0.1
    assert r["rows"]["torch, after prestartup"]["seconds"] == pytest.approx(0.3)
    assert r["ratio"] == pytest.approx(0.1 / 1.5)
    seen.clear()
    figures = iter([0.5] * 6)
    startup_cost.measure_startup(1)  # the cached-bytecode run: one warm-up of each kind first
    assert seen == [("torch", True), ("auto", True), ("started", True)] * 2
