"""What membackend's prestartup script adds to ComfyUI's start-up in the real tree, against ``import torch``.

A report item, not a timing test: the medians and ratios go to the report folder (``startup_cost``);
the test only checks that every measuring interpreter ran and that the prestartup printed its line
without importing torch.
"""

from __future__ import annotations

from . import harness


def test_startup_cost_report(trees, comfy_python, report) -> None:
    got = harness.measure_cost(trees.node, python=comfy_python)
    report.put("startup_cost", got)
    for side, row in got["rows"].items():
        assert len(row["rounds"]) == got["rounds"], (side, row)
        if side.startswith("prestartup"):
            assert row["torch_imported_by_prestartup"] is False, f"{side}: the prestartup script imported torch"
            assert row["log"], f"{side}: the prestartup script printed no membackend line"
