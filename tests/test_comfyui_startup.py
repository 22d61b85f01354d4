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
