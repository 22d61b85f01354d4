"""Every test starts with no MEMBACKEND_* variables and no OCL_SET_SVM_SIZE, in an empty directory
(the kit's ``membackend_clean_env``, plus the one variable of ROCm's own that this plugin reads)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_env(membackend_clean_env, monkeypatch):
    monkeypatch.delenv("OCL_SET_SVM_SIZE", raising=False)
