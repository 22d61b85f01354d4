"""The conformance kit passes on this plugin over the simulated GB10, run as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: the whole kit in a subprocess: the kit's long part
pytestmark = pytest.mark.kit_long


def test_the_conformance_kit_passes_on_unified_gb10_over_the_gb10_profile(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "membackend.testing.conformance", "-q", "-p", "no:cacheprovider",
         "--membackend-backend", "unified_gb10:gb10-128gb", "--membackend-examples", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # checked against the driver's own tables, with injected failures; nothing left unchecked but host_capacity
    checked = next(x for x in out.splitlines() if x.startswith("membackend kit: unified_gb10:gb10-128gb: checked: "))
    for check in ("ledger vs driver (membackend_inspect)", "budget vs the machine (the simulated gb10-128gb pool",
                  "partial frees", "leaks after close"):
        assert check in checked, checked
    assert "not checked" not in out, out[-4000:]
    assert " passed" in out and " failed" not in out
