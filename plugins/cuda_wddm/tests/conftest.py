"""Every cuda_wddm test starts with no MEMBACKEND_* variables, in an empty directory."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("MEMBACKEND_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
