"""Start-up matrix: ComfyUI flags x membackend selection x comfy-aimdo version, ``--quick-test-for-ci``.

For each case the adapter run (tree with membackend's node) is compared with the stock run (same flags
and comfy-aimdo, tree without the node): wherever stock exits 0 the adapter run does too; exactly one
membackend line is printed by the prestartup script, at most 200 characters, saying ``using <backend>``
when membackend takes over and ``ComfyUI runs stock`` (with ``off`` when disabled) when it does not; no
traceback appears that stock does not print; both runs imported the comfy-aimdo asked for. membackend
takes over only where ComfyUI runs its dynamic path (here: ``--cpu --enable-dynamic-vram``) with a
simulated GPU profile selected.

Default: the CI subset (``harness.CI_CASES``); ``MEMBACKEND_COMFYUI_MATRIX=full``: every combination.
"""

from __future__ import annotations

import os

import pytest

from . import harness

MODE = "full" if (os.environ.get("MEMBACKEND_COMFYUI_MATRIX") or "").strip().lower() == "full" else "ci"
CASES = harness.matrix_cases(MODE)


def _param(case: harness.Case):
    marks = [] if case in harness.CI_CASES else [pytest.mark.real_comfyui_full]
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_startup_matrix(case: harness.Case, matrix) -> None:
    got = matrix[case]
    if isinstance(got, str):
        pytest.skip(got)
    assert not got.problems, (
        f"{case.id} (expected: {got.expected}; stock exit {got.stock_rc}, adapter exit {got.adapter_rc}):\n  "
        + "\n  ".join(got.problems))


def test_ci_subset_covers_the_matrix() -> None:
    """Every flag set with a simulated profile, every selection, every comfy-aimdo version (no ComfyUI run)."""
    cases = harness.CI_CASES
    assert len(set(cases)) == len(cases)
    assert {c.flags for c in cases if c.selection in harness.PROFILE_BACKENDS} == set(harness.FLAGS)
    assert {c.selection for c in cases} == set(harness.SELECTIONS)
    assert {c.aimdo for c in cases} == set(harness.AIMDO_VERSIONS)
    assert {harness.expected(c) for c in cases} >= {"off", "stock", *(f"using {b}" for b in
                                                                        harness.PROFILE_BACKENDS.values())}
