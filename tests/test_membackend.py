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
