"""Every cuda_wddm test starts with no MEMBACKEND_* variables, in an empty directory (the kit's fixture)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_env(membackend_clean_env):
    """membackend.testing's ``membackend_clean_env``, for every test here."""
