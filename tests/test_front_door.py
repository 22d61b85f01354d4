"""The typed front door: a user's mypy reads ``create_session()``, ``Session``, ``ResidencyManager``,
``load_settings()`` and the lab's session builders as their own types, never ``Any``; the lazy names' typing
blocks name what the lazy lookups return; the settings' declared types are the tables' own; and every optional
member membackend reads from a backend with ``getattr`` is declared, with its docstring, in the contract."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

import membackend
import membackend.lab
import membackend.testing
from membackend import hookspec
from membackend._settings import rules

PACKAGE = Path(membackend.__file__).resolve().parent
ROOT = PACKAGE.parent

#: a user's file: each name of the front door used as a user would, with the type mypy must give it
USER_FILE = '''
from typing import assert_type

import membackend
import membackend.lab
from membackend import Budget, Fault, Reservation, ResidencyManager, Session, create_session, load_settings
from membackend.hookspec import Backend
from membackend.lab import host_session, simulated_session


def use(backend: Backend) -> None:
    s = create_session()
    assert_type(s, Session)
    assert_type(membackend.create_session(headroom="1GiB"), Session)
    assert_type(ResidencyManager(s), ResidencyManager)
    settings = load_settings()
    assert_type(settings.headroom, int | None)
    assert_type(settings.block, list[str])
    assert_type(settings.machine.devices, list[membackend._settings.DeviceOverride] | None)
    assert_type(settings.source_of("headroom"), str)
    assert_type(simulated_session("h200"), Session)
    assert_type(membackend.lab.simulated_session("wddm-6gb"), Session)
    assert_type(host_session(), Session)
    assert_type(Session(backend, machine=s.machine), Session)
    r = s.reserve("cpu", 1 << 20)
    assert_type(r, Reservation)
    assert_type(s.fault(r, 0, 4096), Fault)
    assert_type(s.budget_query("cpu"), Budget)
'''

#: the check can fail: an ``Any`` and a misspelt lazy name in a user's file are both reported
PLANTED = '''
import json

import membackend.lab

anything = json.loads("1")
misspelt = membackend.lab.simulated_sesion
'''


def test_a_users_mypy_reads_the_front_door_without_any(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra (scripts/setup installs it)")
    (tmp_path / "user_code.py").write_text(textwrap.dedent(USER_FILE))
    (tmp_path / "planted.py").write_text(textwrap.dedent(PLANTED))
    # membackend as a user's mypy finds an installed typed package: its own errors are not the user's
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--disallow-any-expr", "--follow-imports=silent",
                        "--no-incremental", "--config-file=", "--cache-dir", str(tmp_path / "cache"),
                        "user_code.py", "planted.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    found = sorted(set(re.findall(r"^(\w+\.py):(\d+): error", out, re.M)))
    assert found == [("planted.py", "6"), ("planted.py", "7")], out
    assert 'Module has no attribute "simulated_sesion"' in out, out


def _typing_names(path: Path) -> set[str]:
    """The names an ``if TYPE_CHECKING:`` block of ``path`` imports."""
    tree = ast.parse(path.read_text())
    return {alias.asname or alias.name for node in tree.body
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}


def test_each_lazy_name_is_imported_for_type_checkers_from_where_it_is_looked_up():
    """Besides the lazy names, each block names the old names kept for one release (issue 44: the moved errors'
    in the facade, the stock managers' in the lab), so that a checker reads them as the runtime answers them."""
    from membackend.lab._replay.stock import RENAMED

    assert _typing_names(PACKAGE / "__init__.py") == set(membackend._LAZY) | set(membackend._MOVED)
    # the lab's errors are imported at once, not on first use: only its builders are lazy
    for package, lazy, default, old in ((membackend.testing, membackend.testing.__all__, "harness", ()),
                                        (membackend.lab, list(membackend.lab._HOME), None, RENAMED)):
        path = PACKAGE.joinpath(*package.__name__.split(".")[1:], "__init__.py")
        assert _typing_names(path) == set(lazy) | set(old)
        for name in lazy:  # the block names the object the lookup returns
            home = package._HOME.get(name, default)
            assert getattr(package, name) is getattr(sys.modules[f"{package.__name__}.{home}"], name), name
    from membackend._session import Session

    assert membackend.Session is Session  # the __getattr__ hidden from type checkers answers at run time
    with pytest.raises(AttributeError, match="no attribute 'Sesion'"):
        membackend.Sesion


def _written(annotation: object) -> str:
    """A table's annotation as the typing block writes it (``str | None``, ``bool``, ``Path | None``)."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return text.replace("pathlib.", "")


def test_the_settings_types_a_type_checker_sees_are_the_tables_own():
    tree = ast.parse((PACKAGE / "_settings" / "typed.py").read_text())
    declared = {node.name: {s.target.id: ast.unparse(s.annotation) for s in node.body
                            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    nested = {"machine": "MachineOverrides", "devices": "list[DeviceOverride] | None"}
    for model, table in (("Settings", rules.FIELDS), ("MachineOverrides", rules.MACHINE_FIELDS),
                         ("DeviceOverride", rules.DEVICE_FIELDS)):
        assert declared[model] == {f.name: nested.get(f.name) or _written(f.annotation) for f in table}, model


#: ``getattr(x, "member", ...)`` / ``hasattr(x, "member")`` where x is a backend (or a plugin, a record's plugin)
_READ = re.compile(r"\b(?:getattr|hasattr)\(\s*([\w.]*(?:backend|plugin))\s*,\s*[\"'](\w+)[\"']")


def test_every_optional_member_membackend_reads_is_declared_with_its_docstring():
    # the replay reads switches of its own stock model (carry_on), no backend's; a dunder only labels a plugin
    read = {(str(p.relative_to(ROOT)), m.group(2)) for p in PACKAGE.rglob("*.py") if "_replay" not in p.parts
            for m in _READ.finditer(p.read_text()) if not m.group(2).startswith("__")}
    assert read, "the scan found no getattr of a backend: the pattern is out of date"
    required = {"name", "device_kinds", *hookspec.HOOKS, *hookspec.OPTIONAL_HOOKS}
    undeclared = sorted(f"{where}: {member}" for where, member in read
                        if member not in required and member not in hookspec.OPTIONAL_MEMBERS)
    assert undeclared == []
    protocol = hookspec.OptionalMembers
    source = inspect.getsource(protocol)
    for member in hookspec.OPTIONAL_MEMBERS:
        fn = protocol.__dict__.get(member)
        if fn is not None:  # a method (from_settings: a classmethod)
            assert inspect.getdoc(getattr(fn, "__func__", fn)), f"{member} has no docstring"
        else:  # an attribute: annotated, its documentation comment the line above
            assert member in protocol.__annotations__, f"{member} is not declared on OptionalMembers"
            assert re.search(rf"#:[^\n]*\n(?:\s*#:[^\n]*\n)*\s*{member}: ", source), f"{member} has no #: comment"
    assert set(protocol.__annotations__) | {n for n in protocol.__dict__ if callable(getattr(protocol, n, None))
                                            and not n.startswith("_")} >= set(hookspec.OPTIONAL_MEMBERS)


def test_a_session_takes_the_backend_protocol():
    from membackend._session import Session

    assert typing.get_type_hints(Session.__init__)["backend"] is hookspec.Backend
