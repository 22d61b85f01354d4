"""Every call a real ComfyUI tree makes into comfy-aimdo is accounted for: served by membackend's facade with a
signature that accepts the tree's own call, left to comfy-aimdo with the reason (``wiring.LEFT_TO_AIMDO``), or
kept out by a ComfyUI switch membackend turns on -- the one answer ``membackend._comfyui.aimdo_names`` gives it
(``tests/test_comfyui_aimdo_names.py`` checks that table against every public name of each comfy-aimdo release).

The tree is the one named by ``MEMBACKEND_COMFYUI`` (``.ci/run`` points it at a real ComfyUI 0.33.0); the
calls are read from its source with ``ast``, so a newer tree that calls a new name fails here until the
adapter serves it or says why not."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
from pathlib import Path

import pytest

pytest.importorskip("comfy_aimdo")

from membackend._comfyui import aimdo_names, wiring  # noqa: E402

TREE = os.environ.get("MEMBACKEND_COMFYUI")
needs_tree = pytest.mark.skipif(not TREE, reason="MEMBACKEND_COMFYUI (a ComfyUI tree) is not set")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


@functools.lru_cache(maxsize=None)
def aimdo_uses(tree: Path) -> dict[str, list[tuple[str, ast.Call | None]]]:
    """``comfy_aimdo.<module>.<name>`` -> [(file:line, the call node or None when only referenced)]."""
    uses: dict[str, list[tuple[str, ast.Call | None]]] = {}
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(tree)
        if rel.parts[0] in ("tests", "tests-unit", "custom_nodes"):
            continue
        source = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(rel))
        aliases = {}  # local name -> comfy_aimdo.<module>.<name>, from "from comfy_aimdo.x import y"
        for node in ast.walk(source):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("comfy_aimdo."):
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        calls = {id(n.func): n for n in ast.walk(source) if isinstance(n, ast.Call)}
        for node in ast.walk(source):
            name = None
            if isinstance(node, ast.Attribute):
                dotted = _dotted(node)
                if dotted and dotted.startswith("comfy_aimdo.") and dotted.count(".") == 2:
                    name = dotted
            elif isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load):
                name = aliases[node.id]
            if name is not None:
                uses.setdefault(name, []).append((f"{rel}:{node.lineno}", calls.get(id(node))))
    return uses


def _accepts(fn, call: ast.Call) -> str | None:
    """None when ``fn`` accepts the call's shape (positional count, keyword names); else why not."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    sig = inspect.signature(target)
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    sig = sig.replace(parameters=params)
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs at the call site: nothing to check statically
    try:
        sig.bind(*range(len(call.args)), **{k.arg: None for k in call.keywords})
    except TypeError as exc:
        return str(exc)
    return None


@needs_tree
def test_every_comfy_aimdo_name_the_tree_uses_is_served_left_with_a_reason_or_kept_out():
    uses = aimdo_uses(Path(TREE))
    assert "comfy_aimdo.model_vbar.vbar_fault" in uses, "the tree looks like no aimdo-era ComfyUI"
    rows = aimdo_names.table()
    unaccounted = {name: [where for where, _ in sites] for name, sites in uses.items()
                   if aimdo_names.answer(name, rows) is None}
    assert not unaccounted, f"comfy-aimdo names this ComfyUI uses that the adapter neither serves nor lists: " \
                            f"{unaccounted}"
    assert all(len(why) > 20 for why in wiring.LEFT_TO_AIMDO.values())


def test_a_name_the_table_does_not_answer_is_reported():
    rows = aimdo_names.table()
    assert aimdo_names.answer("comfy_aimdo.control.init_devices", rows).kind == aimdo_names.SERVED
    assert aimdo_names.answer("comfy_aimdo.malloc_graph.record", rows).kind == aimdo_names.KEPT
    assert aimdo_names.answer("comfy_aimdo.control.brand_new_call", rows) is None


@needs_tree
def test_every_served_name_accepts_the_trees_own_calls():
    served = wiring.served()
    wrong = []
    for name, sites in aimdo_uses(Path(TREE)).items():
        if name not in served:
            continue
        for where, call in sites:
            if call is not None and (why := _accepts(served[name], call)):
                wrong.append(f"{where} {name}: {why}")
    assert not wrong, wrong


@pytest.mark.parametrize("name", sorted(wiring.served()))
def test_every_served_name_has_the_installed_comfy_aimdos_signature(name):
    modname, attr = name.rsplit(".", 1)
    theirs = getattr(importlib.import_module(modname), attr, None)
    if theirs is None:
        pytest.skip(f"this comfy-aimdo has no {name} (another release may)")
    ours = wiring.served()[name]

    def params(fn):
        target = fn.__init__ if inspect.isclass(fn) else fn
        ps = list(inspect.signature(target).parameters.values())
        return [(p.name, p.kind, p.default) for p in ps if p.name != "self"]
    if ours is wiring.aimdo_log_noop:
        assert params(theirs) == []  # aimdo's set_log_<level>() take nothing; ours takes anything
        return
    assert params(ours) == params(theirs)
    if inspect.isclass(theirs):
        public = {n for n in dir(theirs) if not n.startswith("_")}
        assert public <= set(dir(ours)), public - set(dir(ours))
        for method in public:
            if callable(getattr(theirs, method)):
                assert params(getattr(ours, method)) == params(getattr(theirs, method)), method
