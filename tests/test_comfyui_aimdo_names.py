"""Every public name of comfy-aimdo 0.4.13, 0.5.5 and 0.6.0 has exactly one answer in
``membackend._comfyui.aimdo_names`` -- served, left to comfy-aimdo with the reason, or kept out by a ComfyUI
switch membackend turns on -- and the names are read from the installed wheels, never from a list kept by hand.

Each release runs in a child Python with its folder first on ``PYTHONPATH`` (as tests/real_comfyui does):
``MEMBACKEND_COMFYUI_PYTHON`` (default ``<repo>/.venv-comfyui/bin/python``, which scripts/comfyui-python
builds) has one release in its site-packages and the others in ``<venv>/aimdo/<version>/``; this test's own
Python counts too for the release it has. The child lists each module's public names (``dir()`` of the
imported module, less what the module imports; its source parsed with ``ast`` where the import fails), each
class's own public members and constructor parameters, and every signature. A release found nowhere is
skipped with the reason. The new drop-ins (``membackend._comfyui.aimdo_newer``) are run here too: no call of
theirs reaches aimdo's library."""

from __future__ import annotations

import argparse
import ctypes
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("comfy_aimdo")

import comfy_aimdo.control as control  # noqa: E402
import comfy_aimdo.host_buffer as host_buffer  # noqa: E402

from membackend._comfyui import aimdo_names, aimdo_newer, wiring  # noqa: E402
from membackend._comfyui import runtime as adapter  # noqa: E402
from membackend._comfyui.headroom import LIVE_SOURCE  # noqa: E402
from membackend._comfyui.runtime import Runtime  # noqa: E402
from membackend._drivers.open import machine_for  # noqa: E402
from membackend._manager import BackendManager  # noqa: E402
from membackend._settings import load_settings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("0.4.13", "0.5.5", "0.6.0")
_GIVEN = os.environ.get("MEMBACKEND_COMFYUI_PYTHON") or None  # read once: each test runs with MEMBACKEND_* cleared
COMFY_PYTHON = Path(_GIVEN).expanduser().absolute() if _GIVEN else REPO / ".venv-comfyui" / "bin" / "python"
TREE = os.environ.get("MEMBACKEND_COMFYUI") or None
DOCS = REPO / "docs" / "comfyui.md"

#: run by each release's Python: prints {"version", "where", "modules": {module: {"error", "names": {...}}}}
READER = r'''
import ast, importlib, inspect, json, os, sys

def params(fn):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in sig.parameters.values()]

def bound(body, imported, defined):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                defined.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                bound(getattr(node, field, []) or [], imported, defined)
            for handler in getattr(node, "handlers", []) or []:
                bound(handler.body, imported, defined)

import comfy_aimdo
pkgdir = list(comfy_aimdo.__path__)[0]
out = {"version": importlib.import_module("comfy_aimdo._version").__version__, "where": pkgdir, "modules": {}}
for fname in sorted(os.listdir(pkgdir)):
    if not fname.endswith(".py") or fname.startswith("_"):
        continue
    modname = fname[:-3]
    tree = ast.parse(open(os.path.join(pkgdir, fname), encoding="utf-8").read())
    imported, defined = set(), set()
    bound(tree.body, imported, defined)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    entry = {"error": None, "names": {}}
    try:
        mod = importlib.import_module("comfy_aimdo." + modname)
        names = [n for n in dir(mod) if not n.startswith("_") and n not in imported
                 and not inspect.ismodule(getattr(mod, n))]
    except Exception as exc:  # e.g. no torch: the module's own source says what it defines
        mod = None
        entry["error"] = f"{type(exc).__name__}: {exc}"
        names = sorted(n for n in defined if not n.startswith("_"))
    for n in names:
        obj = getattr(mod, n, None) if mod is not None else None
        row = {"kind": "data"}
        if n in classes:
            row.update(kind="class", members={}, init=[])
            if obj is not None:
                for m, v in vars(obj).items():
                    if not m.startswith("_"):
                        row["members"][m] = params(getattr(obj, m)) if callable(v) else None
                row["init"] = params(obj.__init__) if "__init__" in vars(obj) else []
            else:
                for node in classes[n].body:
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        if node.name == "__init__":
                            row["init"] = [[a.arg, "POSITIONAL_OR_KEYWORD", None] for a in node.args.args]
                        elif not node.name.startswith("_"):
                            row["members"][node.name] = None
        elif callable(obj) or (mod is None and n in functions):
            row.update(kind="function", params=params(obj) if obj is not None else None)
        entry["names"][n] = row
    out["modules"][modname] = entry
json.dump(out, sys.stdout)
'''


# --------------------------------------------------------------------------- reading the wheels

def _env(root: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    if root is not None:
        env["PYTHONPATH"] = str(root)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def read_release(python: Path, root: Path | None) -> dict:
    """What :data:`READER` prints for the comfy-aimdo that ``python`` imports with ``root`` first on its path."""
    with tempfile.TemporaryDirectory() as cwd:  # nothing of the working folder shadows the package
        done = subprocess.run([str(python), "-c", READER], check=False, env=_env(root), cwd=cwd, capture_output=True,
                              text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"reading comfy-aimdo with {python} (PYTHONPATH={root}) failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _installed(python: Path) -> str | None:
    try:
        done = subprocess.run([str(python), "-c", "import comfy_aimdo._version as v; print(v.__version__)"],
                              check=False, env=_env(None), capture_output=True, text=True, timeout=120,
                              cwd=tempfile.gettempdir())
    except OSError:
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


@functools.cache
def releases() -> dict[str, dict | str]:
    """Each of :data:`VERSIONS`: what its wheel holds, or why it cannot be read here."""
    where: dict[str, tuple[Path, Path | None]] = {}
    for python in (COMFY_PYTHON, Path(sys.executable)):
        if not python.exists():
            continue
        installed = _installed(python)
        if installed:
            where.setdefault(installed, (python, None))
        venv = python.parent.parent  # <venv>/bin/python; links are not followed (scripts/comfyui-python's layout)
        for version in VERSIONS:
            folder = venv / "aimdo" / version
            if (folder / "comfy_aimdo" / "_version.py").is_file():
                where.setdefault(version, (python, folder))
    how = "MEMBACKEND_COMFYUI_PYTHON" if _GIVEN else "the default, MEMBACKEND_COMFYUI_PYTHON unset"
    out: dict[str, dict | str] = {}
    for version in VERSIONS:
        if version not in where:
            out[version] = (f"comfy-aimdo {version} is not installed: not in {COMFY_PYTHON} ({how}) nor in its "
                            f"venv's aimdo/{version}/, nor in this test's Python; build them with "
                            "scripts/comfyui-python or set MEMBACKEND_COMFYUI_PYTHON")
            continue
        python, root = where[version]
        data = read_release(python, root)
        assert data["version"] == version, f"{python} with {root} first on its path imports comfy-aimdo " \
                                           f"{data['version']} from {data['where']}, not {version}"
        assert root is None or Path(data["where"]).resolve().is_relative_to(root.resolve()), data["where"]
        out[version] = data
    return out


def release(version: str) -> dict:
    data = releases()[version]
    if isinstance(data, str):
        pytest.skip(data)
    return data


def public_names(data: dict) -> dict[str, list | None]:
    """Every public name of one release -> its parameters as aimdo has them (None: no signature to compare).
    A class's are its constructor's; its members and constructor parameters are names of their own."""
    out: dict[str, list | None] = {}
    for module, entry in data["modules"].items():
        for name, row in entry["names"].items():
            full = f"comfy_aimdo.{module}.{name}"
            out[full] = row.get("params")
            if row["kind"] == "class":
                init = [p for p in row.get("init") or [] if p[0] != "self"]
                out[full] = init
                out.update({f"{full}.{m}": ps for m, ps in row["members"].items()})
                out.update({f"{full}.__init__({p[0]})": None for p in init})
    return out


# --------------------------------------------------------------------------- the checks, as functions

def missing(version: str, names, rows=None) -> list[str]:
    """One line per public name of ``version`` that the table does not answer."""
    return [f"comfy-aimdo {version}: {name} has no answer in membackend._comfyui.aimdo_names"
            for name in aimdo_names.unanswered(sorted(names), rows)]


def stale(rows, names_of_every_release) -> list[str]:
    """One line per table entry that no release has (names ComfyUI calls that no release has aside)."""
    return [f"{name} is in the table but in no comfy-aimdo release ({', '.join(VERSIONS)})"
            for name in rows if name not in names_of_every_release and name not in aimdo_names.NOT_IN_ANY_RELEASE]


def accepts(ours, theirs: list) -> str | None:
    """None when membackend's ``ours`` takes every call aimdo's signature ``theirs`` takes (the same names,
    kinds, defaults and positional order; anything more optional); else what differs."""
    target = ours.__init__ if inspect.isclass(ours) else ours
    ps = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    theirs = [t for t in theirs if t[0] != "self"]
    kinds = {p.kind for p in ps}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        return None  # takes anything (the log-level stand-ins)
    mine = {p.name: p for p in ps}
    for name, kind, default in theirs:
        p = mine.get(name)
        if p is None:
            return f"has no parameter {name!r}"
        if p.kind.name != kind:
            return f"{name!r} is {p.kind.name}, aimdo's is {kind}"
        d = None if p.default is inspect.Parameter.empty else repr(p.default)
        if d != default:
            return f"{name!r} defaults to {d}, aimdo's to {default}"
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    order = [p.name for p in ps if p.kind.name in positional]
    want = [t[0] for t in theirs if t[1] in positional]
    if order[:len(want)] != want:
        return f"positional order {order} is not aimdo's {want}"
    extra = [p.name for p in ps if p.name not in {t[0] for t in theirs} and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    return f"needs {extra}, which aimdo's has not" if extra else None


def wrong_signatures(version: str, names: dict[str, list | None], rows=None) -> list[str]:
    rows = aimdo_names.table() if rows is None else rows
    out = []
    for name, theirs in sorted(names.items()):
        a = aimdo_names.answer(name, rows)
        if a is None or a.kind != aimdo_names.SERVED or theirs is None or name.endswith(")"):
            continue
        why = accepts(a.by, theirs)
        if why:
            out.append(f"comfy-aimdo {version}: {name}: {aimdo_names.qualified(a.by)} {why}")
    return out


# --------------------------------------------------------------------------- every release against the table

@pytest.mark.parametrize("version", VERSIONS)
def test_every_public_name_of_the_release_has_an_answer(version):
    names = public_names(release(version))
    assert "comfy_aimdo.model_vbar.ModelVBAR" in names and "comfy_aimdo.control.init_devices" in names, names
    assert not missing(version, names)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_served_name_takes_the_releases_calls(version):
    assert not wrong_signatures(version, public_names(release(version)))


def test_every_table_entry_is_in_some_release():
    names = set()
    for version in VERSIONS:
        names |= set(public_names(release(version)))
    assert not stale(aimdo_names.table(), names)
    assert not aimdo_names.NOT_IN_ANY_RELEASE & names, "a release has it now: answer it like any other name"


def test_the_table_gives_each_name_one_answer():
    rows = aimdo_names.table()
    assert {a.kind for a in rows.values()} == {aimdo_names.SERVED, aimdo_names.LEFT, aimdo_names.KEPT}
    assert all(len(a.why) > 30 for a in rows.values())
    assert all(a.by is not None for a in rows.values() if a.kind == aimdo_names.SERVED)
    assert all(a.flag in aimdo_names.SWITCHES for a in rows.values() if a.kind == aimdo_names.KEPT)
    assert set(wiring.served()) | set(wiring.LEFT_TO_AIMDO) | set(aimdo_names.KEPT_OUT) == set(rows)


def test_the_names_new_since_0_4_13_are_in_the_documentation_with_their_answer():
    old = set(public_names(release("0.4.13")))
    new = set(public_names(release("0.5.5"))) | set(public_names(release("0.6.0")))
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## comfy-aimdo's names"):]
    section = section[:section.index("\n## ", 3)] if "\n## " in section[3:] else section
    rows = aimdo_names.table()
    words = {aimdo_names.SERVED: "served", aimdo_names.LEFT: "left", aimdo_names.KEPT: "kept out"}
    wrong = []
    for name in sorted(new - old):
        top = aimdo_names.module_level(name)[0]
        if top != name and top in new - old:
            continue  # a member of a class new itself: the class's line covers it
        short = name.removeprefix("comfy_aimdo.")
        line = next((ln for ln in section.splitlines() if f"`{short}`" in ln), None)
        found = aimdo_names.answer(name, rows)
        kind = words[found.kind] if found is not None else "(no answer in the table)"
        if line is None or kind not in line:
            wrong.append(f"{short}: no line of docs/comfyui.md's section names it with '{kind}'")
    assert not wrong, wrong


def test_nothing_at_comfyuis_start_up_imports_the_table():
    code = ("import sys, membackend._comfyui.startup, membackend._comfyui.wiring as w; w.served(); "
            "print(sorted(m for m in sys.modules if m.startswith('membackend._comfyui.aimdo')))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "['membackend._comfyui.aimdo_newer']"  # the drop-ins only: the table stays out


# --------------------------------------------------------------------------- the switches

def _cli_flags(tree: Path) -> set[str]:
    import ast

    source = ast.parse((tree / "comfy" / "cli_args.py").read_text(encoding="utf-8"))
    return {a.value for node in ast.walk(source) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "add_argument"
            for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


@pytest.mark.skipif(not TREE, reason="MEMBACKEND_COMFYUI (a ComfyUI tree) is not set")
def test_each_switch_is_in_the_trees_flags_or_the_tree_calls_nothing_it_keeps_out():
    from test_comfyui_aimdo_calls import aimdo_uses  # the same reading of the tree's call sites

    tree = Path(TREE)
    flags = _cli_flags(tree)
    assert "--disable-cuda-graphs" in flags, f"{tree} looks like no aimdo-era ComfyUI"
    uses = aimdo_uses(tree)
    wrong = []
    for flag in aimdo_names.SWITCHES:
        kept = [n for n, (f, _) in aimdo_names.KEPT_OUT.items() if f == flag]
        if flag not in flags and any(n in uses for n in kept):
            wrong.append(f"{tree} calls {[n for n in kept if n in uses]} but has no {flag} to keep them out")
    assert not wrong, wrong


@pytest.fixture
def host_rt():
    """A runtime over the host backend with its session open, as the facade's tests have it."""
    ps = 2 << 20
    settings = load_settings(backend="host", headroom=0, host_capacity=16 * ps, page_size=ps)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    args = argparse.Namespace(disable_comfy_compiler=False, disable_cuda_graphs=False, reserve_vram=None,
                              vram_headroom=0.001)
    rt = Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None, comfy_args=args)
    adapter.decided("armed", "test", "", rt)
    yield rt
    if adapter.current() is rt:  # not stopped by the test itself
        rt.stop()


def test_membackend_turns_each_switch_on_when_it_starts_and_back_when_it_stops(host_rt):
    args = host_rt.comfy_args
    host_rt.start([(0, 0)])
    for flag, (attr, where) in aimdo_names.SWITCHES.items():
        assert where.endswith("Runtime.start") and getattr(args, attr) is True, flag
    host_rt.stop()
    assert all(getattr(args, attr) is False for attr, _ in aimdo_names.SWITCHES.values())


# --------------------------------------------------------------------------- the drop-ins

class _Tripwire:
    """aimdo's library where any use of it fails the test: served names never reach it."""

    def __getattr__(self, name):
        raise AssertionError(f"aimdo's native library was called ({name}) for a device membackend serves")


@pytest.fixture
def running(host_rt, monkeypatch):
    host_rt.start([(0, 0)])
    wiring.install_facade(host_rt)
    monkeypatch.setattr(control, "lib", _Tripwire())
    monkeypatch.setattr(host_buffer, "lib", _Tripwire())
    return host_rt


def test_install_replaces_each_new_name_aimdo_has_and_stop_puts_aimdos_back(host_rt):
    theirs = {(m, n): getattr(sys.modules[m], n) for m, n in aimdo_newer.NAMES}
    host_rt.start([(0, 0)])
    wiring.install_facade(host_rt)
    for m, n in theirs:
        assert getattr(sys.modules[m], n) is getattr(aimdo_newer, n) is wiring.served()[f"{m}.{n}"]
        assert f"{m}.{n}" in host_rt.patches.applied
    host_rt.stop()
    assert all(getattr(sys.modules[m], n) is original for (m, n), original in theirs.items())


def test_the_simple_headroom_is_the_sessions_live_headroom(running):
    dev = running.devices[0]
    extra = int(0.001 * 1024 ** 3)  # --vram-headroom, kept apart as aimdo keeps it
    control.set_simple_vram_headroom(4 << 20)
    assert running.headroom.in_force(dev) == ((4 << 20) + extra, LIVE_SOURCE)
    assert running.session.budget_query(dev).headroom == (4 << 20) + extra
    assert control.get_simple_vram_headroom() == 4 << 20  # what a custom node reads back, then restores
    control.set_simple_vram_headroom(0)
    assert control.get_simple_vram_headroom() == 0 and running.headroom.in_force(dev)[0] == extra
    total = running.session.budget_query(dev).total
    control.set_simple_vram_headroom(1 << 60)  # aimdo's largest: capped at the device's total
    assert running.headroom.in_force(dev)[0] == total
    for bad in (-1, (1 << 60) + 1):
        with pytest.raises(ValueError, match="between 0 and 2\\*\\*60"):
            control.set_simple_vram_headroom(bad)
    assert running.headroom.in_force(dev)[0] == total  # a refused value changes nothing


def test_without_a_running_adapter_the_headroom_fails_like_an_uninitialised_aimdo():
    assert adapter.current() is None
    with pytest.raises(RuntimeError, match="not initialized"):
        aimdo_newer.get_simple_vram_headroom()
    with pytest.raises(RuntimeError, match="not initialized"):
        aimdo_newer.set_simple_vram_headroom(0)


def test_the_file_writers_write_at_the_offset_and_leave_the_file_position(running, tmp_path):
    data = bytes(range(256)) * 64
    src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    path = tmp_path / "out.bin"
    with open(path, "wb+") as f:
        f.write(b"head")
        f.flush()
        host_buffer.write_host_to_file(f, 4, len(data), ctypes.addressof(src))
        # the host backend's "device" memory is process memory: the device writer reads it the same way
        host_buffer.write_device_to_file(f.fileno(), 4 + len(data), 100, 0, ctypes.addressof(src) + 5, 0)
        assert f.tell() == 4
    assert path.read_bytes() == b"head" + data + data[5:105]
    host_buffer.write_host_to_file(str(path), 0, 0, 0)  # nothing to write: nothing asked of the file
    with pytest.raises(RuntimeError, match="xfer_file_write failed"):
        host_buffer.write_host_to_file(-1, 0, 4, ctypes.addressof(src))
    with pytest.raises(RuntimeError, match="hostbuf_file_writer_write failed"):
        host_buffer.write_device_to_file(-1, 0, 4, 0, ctypes.addressof(src), 0)


# --------------------------------------------------------------------------- the checks can fail

def test_the_reader_finds_a_new_name_and_the_table_reports_it(tmp_path):
    pkg = tmp_path / "comfy_aimdo"
    pkg.mkdir()
    (pkg / "_version.py").write_text("__version__ = '9.9.9'\n")
    (pkg / "control.py").write_text("import os\nlib = None\n\ndef init_devices(device_ids):\n    pass\n\n"
                                    "def brand_new(x, y=1):\n    pass\n")
    (pkg / "extra.py").write_text("from os import path\n\nclass Thing:\n    def __init__(self, a, cb=None):\n"
                                  "        pass\n\n    def go(self):\n        pass\n\n    def _hidden(self):\n"
                                  "        pass\n")
    data = read_release(Path(sys.executable), tmp_path)
    assert data["version"] == "9.9.9"
    names = public_names(data)
    assert set(names) == {"comfy_aimdo.control.lib", "comfy_aimdo.control.init_devices",
                          "comfy_aimdo.control.brand_new", "comfy_aimdo.extra.Thing", "comfy_aimdo.extra.Thing.go",
                          "comfy_aimdo.extra.Thing.__init__(a)", "comfy_aimdo.extra.Thing.__init__(cb)"}
    assert names["comfy_aimdo.control.brand_new"] == [["x", "POSITIONAL_OR_KEYWORD", None],
                                                      ["y", "POSITIONAL_OR_KEYWORD", "1"]]
    lines = missing("9.9.9", names)
    assert len(lines) == 5 and all(ln.startswith("comfy-aimdo 9.9.9: ") for ln in lines)
    assert any("comfy_aimdo.control.brand_new has no answer" in ln for ln in lines)


def test_a_member_or_parameter_membackends_class_lacks_is_reported():
    lines = missing("9.9.9", ["comfy_aimdo.model_vbar.ModelVBAR.brand_new_method",
                              "comfy_aimdo.model_vbar.ModelVBAR.__init__(brand_new_parameter)",
                              "comfy_aimdo.model_vbar.ModelVBAR.close",
                              "comfy_aimdo.model_vbar.ModelVBAR.__init__(pageout_callback)",
                              "comfy_aimdo.malloc_graph.MallocGraph.brand_new_method"])
    assert [ln.split(": ")[1].split(" ")[0] for ln in lines] == [
        "comfy_aimdo.model_vbar.ModelVBAR.__init__(brand_new_parameter)",
        "comfy_aimdo.model_vbar.ModelVBAR.brand_new_method"]


def test_a_stale_entry_and_a_second_answer_are_reported(monkeypatch):
    rows = dict(aimdo_names.table())
    rows["comfy_aimdo.control.gone_in_every_release"] = rows["comfy_aimdo.control.lib"]
    assert stale(rows, set(rows) - {"comfy_aimdo.control.gone_in_every_release"}) == [
        "comfy_aimdo.control.gone_in_every_release is in the table but in no comfy-aimdo release "
        "(0.4.13, 0.5.5, 0.6.0)"]
    monkeypatch.setitem(wiring.LEFT_TO_AIMDO, "comfy_aimdo.control.init_devices", "also left? never")
    with pytest.raises(ValueError, match=re.escape("comfy_aimdo.control.init_devices (served() and LEFT_TO_AIMDO)")):
        aimdo_names.table()


def test_a_signature_that_takes_fewer_calls_than_aimdos_is_reported():
    theirs = [["self", "POSITIONAL_OR_KEYWORD", None], ["a", "POSITIONAL_OR_KEYWORD", None],
              ["b", "POSITIONAL_OR_KEYWORD", "None"]]


    def same(a, b=None):
        pass

    def more_optional(a, b=None, c=0):
        pass

    def drops_b(a):
        pass

    def other_default(a, b=0):
        pass

    def needs_c(a, b=None, *, c):
        pass

    def swapped(b, a):
        pass

    def anything(*args, **kwargs):
        pass
    assert accepts(same, theirs) is None and accepts(more_optional, theirs) is None
    assert accepts(anything, theirs) is None
    assert accepts(drops_b, theirs) == "has no parameter 'b'"
    assert accepts(other_default, theirs) == "'b' defaults to 0, aimdo's to None"
    assert accepts(needs_c, theirs) == "needs ['c'], which aimdo's has not"
    both = [["a", "POSITIONAL_OR_KEYWORD", None], ["b", "POSITIONAL_OR_KEYWORD", None]]
    assert accepts(swapped, both) == "positional order ['b', 'a'] is not aimdo's ['a', 'b']"
    assert wrong_signatures("9.9.9", {"comfy_aimdo.control.set_simple_vram_headroom":
                                      [["headroom", "POSITIONAL_OR_KEYWORD", None], ["more", "KEYWORD_ONLY", None]]}
                            ) == ["comfy-aimdo 9.9.9: comfy_aimdo.control.set_simple_vram_headroom: "
                                  "membackend._comfyui.aimdo_newer.set_simple_vram_headroom has no parameter 'more'"]
