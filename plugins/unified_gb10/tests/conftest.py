"""Fixtures of the unified_gb10 tests: a clean environment and workloads on the simulated GB10.

The plugin is found only through its entry point, so these tests need the
distribution installed (``scripts/test`` and ``tox`` install every
``plugins/*/``; by hand: ``pip install --no-deps -e plugins/unified_gb10``).
"""

from __future__ import annotations

import pytest

from membackend._residency import ResidencyManager
from membackend.lab._replay.stock import StockManager

from workload_unified_gb10 import Workload, gb10_session, stock_session


@pytest.fixture(autouse=True)
def _clean_env(membackend_clean_env):
    """No MEMBACKEND_* variables (this plugin's own included), in an empty directory: the kit's fixture."""


@pytest.fixture
def workload():
    """``workload("plugin")``: the membackend policy on the auto-selected backend (this plugin);
    ``workload("stock")``: the stock policy on today's generic VMM; each on a fresh simulated GB10."""
    made = []

    def make(side: str = "plugin") -> Workload:
        w = Workload(gb10_session(), ResidencyManager) if side == "plugin" else Workload(stock_session(), StockManager)
        made.append(w)
        return w

    yield make
    for w in made:
        w.session.close()
