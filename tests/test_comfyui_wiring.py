"""The wiring's table of patch points: each applied once through ``Patches.replace``, each skipped under its label
where this ComfyUI lacks it (or lacks a name its replacement reads), and the adapter's index names every module."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("comfy_aimdo")

import comfy_aimdo.control as control  # noqa: E402
from test_comfyui_startup import comfy_args, originals, serve_cpu  # noqa: E402,F401  (the adapter's fixtures)

import membackend._comfyui as adapter  # noqa: E402
from membackend._comfyui import startup, wiring  # noqa: E402
from membackend._comfyui.patches import MissingName, Patches, _label  # noqa: E402

#: ComfyUI's parsed arguments, the aimdo names restored after each test, the host backend serving as a GPU's would
pytestmark = pytest.mark.usefixtures("comfy_args", "originals", "serve_cpu")


class _Loaded(list):
    """``comfy.model_management.current_loaded_models``."""


def _model_management(**names):
    mm = types.ModuleType("comfy.model_management")
    for name, value in names.items():
        setattr(mm, name, value)
    return mm


def _fn(label):
    def f(*args, **kwargs):
        return (label, args, kwargs)
    return f


class _Dynamic:
    def get_non_dynamic_delegate(self):
        return None

    def load(self, *args, **kwargs):
        return None


class _Queue:
    def task_done(self, item_id):
        return item_id

    def get_tasks_remaining(self):
        return 1


def _everything():
    """A ComfyUI holding every patch point's names (and the names their replacements read)."""
    mm = _model_management(get_free_memory=_fn("free"), get_total_memory=_fn("total"), free_memory=_fn("freed"),
                           current_loaded_models=_Loaded(), load_models_gpu=_fn("load"))
    return mm, types.SimpleNamespace(ModelPatcherDynamic=_Dynamic), types.SimpleNamespace(PromptQueue=_Queue)


def _start(monkeypatch, mm, patcher, execution):
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    for name, module in (("comfy.model_patcher", patcher), ("execution", execution)):
        if module is None:
            monkeypatch.delitem(sys.modules, name, raising=False)
        else:
            monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    monkeypatch.setattr(control, "lib", None)
    rt = startup.prestartup()
    assert rt.init_devices([(0, 0)]) is True
    return rt


def test_every_patch_point_is_applied_once_and_stop_restores_it(monkeypatch):
    mm, patcher, execution = _everything()
    rt = _start(monkeypatch, mm, patcher, execution)
    theirs = {p.label: rt.patches.original(p.owner(), p.name) for p in wiring.PATCH_POINTS}
    assert not {p.label for p in wiring.PATCH_POINTS} & set(rt.patches.skipped)
    for p in wiring.PATCH_POINTS:
        ours = getattr(p.owner(), p.name)
        assert ours.__wrapped__ is theirs[p.label] and ours._membackend == p.name, p.label  # guarded (G6)
        assert rt.patches.applied.count(_label(p.owner(), p.name)) == 1, p.label
    rt.stop()
    for p in wiring.PATCH_POINTS:
        assert getattr(p.owner(), p.name) is theirs[p.label], p.label


@pytest.mark.parametrize("point", wiring.PATCH_POINTS, ids=lambda p: p.label)
def test_a_missing_patch_point_or_a_name_it_reads_is_skipped_under_its_label(
        monkeypatch, point):
    mm, patcher, execution = _everything()
    modules = {"comfy.model_management": mm, "comfy.model_patcher": patcher, "execution": execution}
    owner = {wiring._model_management: mm, wiring._model_patcher_dynamic: patcher.ModelPatcherDynamic,
             wiring._prompt_queue: execution.PromptQueue}[point.owner]
    gone = point.requires[0] if point.requires else point.name
    if isinstance(owner, type):
        monkeypatch.delattr(owner, gone)
    else:
        delattr(owner, gone)
    rt = _start(monkeypatch, *modules.values())
    assert point.label in rt.patches.skipped
    assert [p.label for p in wiring.PATCH_POINTS if p.label in rt.patches.skipped] == [point.label]
    if point.requires:  # the name itself was there and is left as ComfyUI had it
        assert not hasattr(getattr(owner, point.name), "_membackend")
    rt.stop()


def test_a_missing_owner_skips_its_point(monkeypatch):
    mm, _, _ = _everything()
    rt = _start(monkeypatch, mm, None, None)
    assert {"comfy.model_patcher.ModelPatcherDynamic.get_non_dynamic_delegate",
            "execution.PromptQueue.task_done"} <= set(rt.patches.skipped)
    rt.stop()


def test_the_duplicate_budget_pair_answers_each_figure_with_comfyuis_argument_names(
        monkeypatch):
    mm, patcher, execution = _everything()
    rt = _start(monkeypatch, mm, patcher, execution)
    # the host's free memory moves between two reads on a busy machine: one figure for the session to answer
    free, total = 3 << 30, rt.session.budget_query("cpu").total
    monkeypatch.setattr(rt.session, "free_for_host", lambda device: free)
    assert mm.get_free_memory() == free and mm.get_free_memory(None, torch_free_too=True) == (free, free)
    assert mm.get_total_memory() == total and mm.get_total_memory(None, torch_total_too=True) == (total, total)
    gpu = types.SimpleNamespace(type="cuda", index=0)  # a device the host backend does not serve: ComfyUI's
    assert mm.get_free_memory(gpu, torch_free_too=True) == ("free", (gpu, True), {})
    assert mm.get_total_memory(gpu) == ("total", (gpu, False), {})
    rt.stop()


def test_requires_skips_an_optional_patch_and_names_the_missing_name_of_a_required_one():
    owner = types.SimpleNamespace(f=1)
    p = Patches()
    assert p.replace(owner, "f", 2, required=False, requires=("g",), label="the f") is False
    assert owner.f == 1 and p.skipped == ["the f"]
    with pytest.raises(MissingName, match=r"\.g does not exist"):
        p.replace(owner, "f", 2, requires=("g",))
    assert p.replace(None, "f", 2, required=False, label="none") is False and p.skipped == ["the f", "none"]
    owner.g = 0
    assert p.replace(owner, "f", 2, requires=("g",)) is True and owner.f == 2
    assert p.restore() == [] and owner.f == 1


def test_the_adapters_index_names_every_module_of_it():
    folder = Path(adapter.__file__).parent
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    assert {"runtime", "vbar", "wiring"} <= set(modules)  # the glob found the adapter's own files
    missing = [m for m in modules if f":mod:`.{m}`" not in (adapter.__doc__ or "")]
    assert missing == []
