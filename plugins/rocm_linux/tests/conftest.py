"""Every test starts with no MEMBACKEND_* variables, in an empty directory (the kit's ``membackend_clean_env``).

The plugin is found only through its entry point, so these tests need the distribution installed
(``scripts/test`` and ``tox`` install every ``plugins/*/``; by hand: ``pip install --no-deps -e plugins/rocm_linux``).
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_env(membackend_clean_env):
    """No MEMBACKEND_* variables (this plugin's own included), in an empty directory: the kit's fixture."""
