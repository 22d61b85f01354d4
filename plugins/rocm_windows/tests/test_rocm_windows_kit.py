"""The conformance kit passes on rocm_windows over the simulated Windows ROCm machine, checked fully."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: the whole kit in a subprocess: the kit's long part
pytestmark = pytest.mark.kit_long

TARGET = "rocm_windows:rocm-win-2gpu"


def test_conformance_kit_passes_on_the_plugin_over_rocm_win_2gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_") and k != "OCL_SET_SVM_SIZE"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "membackend.testing.conformance",
         "--membackend-backend", TARGET, "--membackend-examples", "5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    checked = next(x for x in out.splitlines() if x.startswith(f"membackend kit: {TARGET}: checked: "))
    for check in ("ledger vs driver (membackend_inspect)", "budget vs the machine", "partial frees",
                  "leaks after close"):
        assert check in checked, checked
    assert f"membackend kit: {TARGET}: not checked" not in out, out[-2000:]
