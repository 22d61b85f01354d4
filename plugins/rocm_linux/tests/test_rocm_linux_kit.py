"""The conformance kit passes on rocm_linux over each simulated AMD-on-Linux machine it serves, checked fully
(the budget against the simulation's own figures: an APU's pool on Strix Halo, the card's memory elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rocm_linux_sessions import SELECTED

#: the whole kit over each profile: the kit's long part
pytestmark = pytest.mark.kit_long


@pytest.mark.parametrize("profile", SELECTED)
def test_conformance_kit_passes_on_the_plugin(tmp_path, profile):
    target = f"rocm_linux:{profile}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "membackend.testing.conformance",
         "--membackend-backend", target, "--membackend-examples", "5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    checked = next(x for x in out.splitlines() if x.startswith(f"membackend kit: {target}: checked: "))
    for check in ("ledger vs driver (membackend_inspect)", "budget vs the machine", "partial frees",
                  "leaks after close", "where the platform fits"):
        assert check in checked, checked
    assert f"membackend kit: {target}: not checked" not in out, out[-2000:]
