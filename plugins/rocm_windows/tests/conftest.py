"""Every test starts with no MEMBACKEND_* variables and no OCL_SET_SVM_SIZE, in an empty directory."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("MEMBACKEND_") or key == "OCL_SET_SVM_SIZE":
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
