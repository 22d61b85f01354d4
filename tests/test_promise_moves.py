"""What the promise covers, after issue 44's moves: the lab's errors live in the lab (``membackend.lab``) and the
installer's in the installer (``membackend._comfyui.install``), out of ``membackend``'s names and
``membackend.types.__all__``; ``ResidencyManager.policy`` is the ``ResidencyPolicy`` (its name
``policy_name``); the lab's stock managers are called managers. Each old name still gives the same object for
one release, with a DeprecationWarning naming the new one, and nothing inside membackend uses an old name."""

from __future__ import annotations

import ast
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import membackend
import membackend.lab
from membackend import ResidencyManager, ResidencyPolicy, types
from membackend._comfyui import install
from membackend.lab import simulated
from membackend.lab._replay import stock

ROOT = Path(membackend.__file__).resolve().parent

LAB_ERRORS = ["UnknownScenario", "ReplayError", "PluginMissing", "TraceError", "TraceWriteError", "TimelineError",
              "PlotUnavailable", "PlotFormatError", "StartupCostError"]
INSTALLER_ERRORS = ["NotComfyUI", "ForeignFolder", "UnsafeLayout", "CannotWrite"]
HOMES = {**dict.fromkeys(LAB_ERRORS, membackend.lab), **dict.fromkeys(INSTALLER_ERRORS, install)}
RENAMED = {"StockPolicy": "StockManager", "AimdoLoadPolicy": "AimdoLoadManager"}


# --------------------------------------------------------------------------- the errors that moved


@pytest.mark.parametrize("name", list(HOMES))
def test_a_moved_error_imports_from_its_home_without_a_warning(name):
    home = HOMES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls = getattr(home, name)
    assert issubclass(cls, types.MembackendError) and cls.__name__ == name
    assert cls.__module__ == home.__name__  # its name, its repr and pickle say where it lives
    assert name in home.__all__
    if name != "TraceWriteError":  # (that one is built from a path and an OSError)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = pickle.loads(pickle.dumps(cls("said")))
        assert type(again) is cls and str(again) == "said"


@pytest.mark.parametrize("old_home", [membackend, types], ids=["membackend", "membackend.types"])
@pytest.mark.parametrize("name", list(HOMES))
def test_the_old_import_warns_naming_the_home_and_gives_the_same_class(name, old_home):
    home = HOMES[name]
    with pytest.warns(DeprecationWarning, match=rf"{old_home.__name__}\.{name} is deprecated: import {name} "
                                                rf"from {re.escape(home.__name__)}") as caught:
        old = getattr(old_home, name)
    assert caught[0].filename == __file__  # at the caller's line, not inside membackend
    assert old is getattr(home, name)
    with pytest.warns(DeprecationWarning):  # each use warns: the old name is not kept
        assert getattr(old_home, name) is old


def test_the_old_from_import_still_works_and_except_clauses_catch_both_ways():
    with pytest.warns(DeprecationWarning, match="membackend.types.TraceError is deprecated"):
        from membackend.types import TraceError
    with pytest.warns(DeprecationWarning, match="membackend.NotComfyUI is deprecated"):
        from membackend import NotComfyUI
    with pytest.raises(TraceError):
        raise membackend.lab.TraceError("line 1: not JSON")
    with pytest.raises(membackend.lab.TraceError):
        raise TraceError("line 1: not JSON")
    assert isinstance(install.NotComfyUI("x"), NotComfyUI)


def test_the_moved_names_are_promised_nowhere_but_at_their_homes():
    moved = set(HOMES)
    assert not moved & set(types.__all__)
    assert not moved & set(membackend.__all__)
    assert not moved & set(dir(membackend)) and not moved & set(dir(types))
    # every error still promised by membackend.types is raised by more than the lab and the installer
    promised = [n for n in types.__all__ if isinstance(getattr(types, n), type)
                and issubclass(getattr(types, n), BaseException)]
    assert len(promised) == 26 and all(getattr(membackend, n) is getattr(types, n) for n in promised)


def test_a_misspelt_name_is_still_an_attribute_error():
    for module in (membackend, types):
        with pytest.raises(AttributeError, match="has no attribute 'ReplayErorr'"):
            module.ReplayErorr  # noqa: B018


def test_the_moved_errors_are_raised_only_by_the_lab_or_the_installer():
    """Why they moved: outside membackend/types.py, only modules of the lab (or, for the installer's, the
    installer) name them at all."""
    pattern = re.compile(r"\b(" + "|".join(HOMES) + r")\b")
    named: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "types.py":
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            for name in pattern.findall(code):
                named.setdefault(name, set()).add(rel)
    for name, where in named.items():
        allowed = ("lab/",) if name in LAB_ERRORS else ("_comfyui/install.py",)
        assert all(w.startswith(allowed) or w in ("__init__.py", "_trace.py") for w in where), (name, where)


# --------------------------------------------------------------------------- the manager's policy


def test_the_managers_policy_is_the_residency_policy_and_its_name_is_policy_name(tmp_path):
    from membackend.lab import host_session

    s = host_session(capacity="64MiB", headroom="0")
    try:
        rules = ResidencyPolicy()
        m = ResidencyManager(s, policy=rules)
        assert m.policy is rules and m.policy_name == "membackend" == rules.name
        default = ResidencyManager(s)
        assert isinstance(default.policy, ResidencyPolicy) and default.policy_name == "membackend"
        with pytest.warns(DeprecationWarning, match="ResidencyManager.rules is deprecated: it is "
                                                    "ResidencyManager.policy") as caught:
            assert m.rules is rules
        assert caught[0].filename == __file__
        stocked = stock.StockManager(s)
        assert isinstance(stocked.policy, stock.AimdoStock) and stocked.policy_name == "stock"
        assert stock.AimdoLoadManager(s).policy_name == "stock"
    finally:
        s.close()


def test_a_trace_event_names_the_policy_by_its_name():
    """The tracer's ``policy`` field stays the policy's name, a string."""
    from membackend.lab import host_session

    events: list[dict] = []

    class Watch:
        def event(self, name, **fields):
            events.append(fields)

    s = host_session(capacity="64MiB", headroom="0")
    try:
        m = ResidencyManager(s, tracer=Watch())
        model = m.register("a", 4 << 20, "cpu")
        m.use([model])
        m.fault(model, 0, model.size)
        m.unload_all()
    finally:
        s.close()
    assert events and {e["policy"] for e in events if "policy" in e} == {"membackend"}


# --------------------------------------------------------------------------- the stock managers


@pytest.mark.parametrize("module", [membackend.lab, simulated, stock], ids=lambda m: m.__name__)
@pytest.mark.parametrize("old", list(RENAMED))
def test_the_stock_managers_old_names_warn_and_give_the_same_class(old, module):
    new = RENAMED[old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls = getattr(module, new)
    assert issubclass(cls, ResidencyManager) and not issubclass(cls, ResidencyPolicy) and cls.__name__ == new
    assert new in module.__all__ and old not in module.__all__
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(module.__name__)}\.{old} is deprecated: it is a "
                                                rf"residency manager, {re.escape(module.__name__)}\.{new}") as caught:
        assert getattr(module, old) is cls
    assert caught[0].filename == __file__


# --------------------------------------------------------------------------- nothing inside uses an old name


def _old_imports(text: str, rel: str) -> list[str]:
    """``from membackend.types import X`` (or ``membackend``) of a moved error ``X`` in module ``rel``'s ``text``,
    as imported at run time: what a type checker alone reads (``if TYPE_CHECKING:``) is left out."""
    tree = ast.parse(text)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for stmt in node.body for n in ast.walk(stmt)}
    return [f"{rel}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and id(node) not in typing_only
            and (node.module or "").split(".")[-1] in ("types", "membackend") and node.module != "typing"
            and any(a.name in HOMES for a in node.names)]


def test_nothing_inside_membackend_uses_an_old_name():
    """No module of the package imports a moved error from its old home or names a renamed manager, and
    importing the package's modules that use them raises no DeprecationWarning."""
    renamed = re.compile(r"\b(StockPolicy|AimdoLoadPolicy)\b")
    members = sorted(n for n in vars(ResidencyPolicy) if not n.startswith("_"))
    rules = re.compile(r"\.rules\.(" + "|".join(members) + r")\b")  # a manager's policy read by its old name
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        found += _old_imports(path.read_text(), rel)
        found += [f"{rel}: {m.group(0)}" for m in rules.finditer(path.read_text())]
        if rel not in ("lab/_replay/stock.py", "lab/simulated.py", "lab/__init__.py"):  # the aliases' own homes
            found += [f"{rel}: {m.group(0)}" for m in renamed.finditer(path.read_text())]
    assert found == []
    code = ("import warnings\n"
            "warnings.filterwarnings('error', '(membackend|ResidencyManager)\\\\.', DeprecationWarning)\n"
            "import membackend, membackend.types, membackend.lab, membackend.lab.simulated, membackend.lab.bench\n"
            "import membackend.lab._replay.compare, membackend.lab._pictures, membackend.lab.startup_cost\n"
            "import membackend._comfyui.install, membackend._cli\n"
            "from membackend.lab import *\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_the_check_sees_a_planted_old_import():
    planted = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..types import TraceError\n"
               "def f():\n    from ...types import Device, ReplayError\n    from ..types import _ReplayError as X\n")
    assert _old_imports(planted, "lab/probe.py") == ["lab/probe.py: from ...types import Device, ReplayError"]
