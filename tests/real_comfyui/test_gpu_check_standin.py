"""scripts/gpu-check's real-ComfyUI check (benchmarks/bench_comfyui_gpu.py) run here as it runs on a GPU, with
``--standin``: the same tree served stock (``--cpu``) and with membackend on a simulated H200 that holds real
bytes, the same seeds, the same phases of the default cache. No time is judged (a CPU says nothing of a GPU's);
what is: every phase ran on both sides, membackend's images equal stock's, the warm prompt loaded nothing, the
JSON and the markdown are written."""

from __future__ import annotations

import json
import subprocess

from . import harness

CHECK = harness.REPO / "benchmarks" / "bench_comfyui_gpu.py"


def test_the_comfyui_check_runs_every_default_phase_on_both_sides(rc_settings, comfy_python, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([comfy_python.path, str(CHECK), "--tree", str(rc_settings.tree), "--python", comfy_python.path,
                        "--standin", "--configs", "default", "--warm", "1", "--steps", "2", "--size", "64",
                        "--out", str(out)], capture_output=True, text=True, timeout=1500, cwd=harness.REPO)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    got = json.loads((out / "comfyui-gpu.json").read_text())
    assert "error" not in got, got.get("error")
    rows = {(r["side"], r["phase"]): r for r in got["rows"] if r["config"] == "default"}
    phases = ["cold", "warm", "other model", "first again", "after free"]
    assert set(rows) == {(side, ph) for side in ("stock", "membackend") for ph in phases}, sorted(rows)
    for ph in phases:
        mine = rows[("membackend", ph)]
        assert mine["equal"] is True, (ph, mine.get("difference"))
        assert mine["seconds"] and rows[("stock", ph)]["seconds"] and mine["ratio"] > 0, mine
    assert rows[("membackend", "cold")]["loaded"] > 0 and rows[("membackend", "warm")]["loaded"] == 0
    md = (out / "comfyui-gpu.md").read_text()
    assert "| default | warm | membackend |" in md and md.strip() == p.stdout.strip()
