"""The package facade (``membackend/__init__.py``): every exported name resolves, the lazy ones are the
internal modules' own objects and are imported only when first asked for, and ``create_session`` works."""

from __future__ import annotations

import subprocess
import sys

import pytest

import membackend
from membackend import types


def test_every_exported_name_resolves_and_the_value_types_are_the_types_modules():
    missing = [name for name in membackend.__all__ if not hasattr(membackend, name)]
    assert missing == []
    assert [n for n in types.__all__ if getattr(membackend, n) is not getattr(types, n)] == []


def test_the_lazy_names_are_the_internal_objects():
    from membackend._residency import ResidencyManager
    from membackend._session import Session
    from membackend._settings import load_settings

    assert (membackend.Session, membackend.ResidencyManager, membackend.load_settings) == \
        (Session, ResidencyManager, load_settings)


def test_importing_the_package_imports_neither_the_session_nor_the_policy_nor_pydantic():
    code = ("import sys, membackend\n"
            "heavy = [m for m in ('membackend._session', 'membackend._residency', 'membackend._manager', 'pydantic')"
            " if m in sys.modules]\n"
            "assert heavy == [], heavy\n"
            "membackend.Session\n"
            "assert 'membackend._session' in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'membackend' has no attribute 'NoSuchThing'"):
        membackend.NoSuchThing  # noqa: B018


def test_create_session_selects_by_the_settings_and_kwargs_win(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    s = membackend.create_session(backend="host")
    try:
        assert s.name == "host" and isinstance(s, membackend.Session)
        r = s.reserve("cpu", 1 << 20)
        assert s.fault(r, 0, r.size).ok
    finally:
        s.close()


def test_python_dash_m_membackend_is_the_command(tmp_path):
    """``python -m membackend`` runs the ``membackend`` command: its help, its version, its exit codes."""
    run = [sys.executable, "-m", "membackend"]
    p = subprocess.run(run + ["--version"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and membackend.__version__ in p.stdout + p.stderr
    p = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("usage: membackend")
    p = subprocess.run(run + ["no-such-command"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "no-such-command" in p.stderr


def test_the_package_is_typed():
    """``py.typed`` ships in the package (PEP 561), so a type checker reads membackend's annotations."""
    from pathlib import Path

    assert (Path(membackend.__file__).parent / "py.typed").is_file()
