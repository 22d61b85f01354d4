"""scripts/gpu-check's real-ComfyUI check (benchmarks/bench_comfyui_gpu.py) run here as it runs on a GPU, with
``--standin``: the same tree served stock (``--cpu``) and with membackend on a simulated H200 that holds real
bytes, the same seeds, the same phases of the default cache. No time is judged (a CPU says nothing of a GPU's);
what is: every phase ran on both sides, membackend's images equal stock's, the warm prompt loaded nothing and ran on
ComfyUI's classic path with no fault or unpin (issue 41, item 1), the cache's configuration read the checkpoint
again from VRAM, 0 bytes from its file (item 2), the JSON and the markdown are written."""

from __future__ import annotations

import json
import subprocess

from . import harness

CHECK = harness.REPO / "benchmarks" / "bench_comfyui_gpu.py"


def test_the_comfyui_check_runs_every_default_phase_on_both_sides(rc_settings, comfy_python, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([comfy_python.path, str(CHECK), "--tree", str(rc_settings.tree), "--python", comfy_python.path,
                        "--standin", "--configs", "default,cache", "--warm", "1", "--steps", "2", "--size", "64",
                        "--out", str(out)], capture_output=True, text=True, timeout=1500, cwd=harness.REPO)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    got = json.loads((out / "comfyui-gpu.json").read_text())
    assert "error" not in got, got.get("error")
    rows = {(r["side"], r["phase"]): r for r in got["rows"] if r["config"] == "default"}
    phases = ["cold", "warm", "warm, profiled", "other model", "first again", "after free"]
    assert set(rows) == {(side, ph) for side in ("stock", "membackend") for ph in phases}, sorted(rows)
    for ph in phases:
        mine = rows[("membackend", ph)]
        assert mine["equal"] is True, (ph, mine.get("difference"))
        assert mine["seconds"] and rows[("stock", ph)]["seconds"] and mine["ratio"] > 0, mine
    assert rows[("membackend", "cold")]["loaded"] > 0 and rows[("membackend", "warm")]["loaded"] == 0
    # issue 41, item 1: the warm prompt runs the resident models on ComfyUI's classic path, with no fault or unpin
    warm = rows[("membackend", "warm")]
    assert (warm["faults"], warm["unpins"]) == (0, 0) and "BaseModel" in warm["classic"], warm
    profiled = next(r for r in got["rows"] if r["phase"] == "warm, profiled" and r["side"] == "membackend")
    assert profiled["profile"]["total_s"] > profiled["profile"]["membackend_s"] > 0, profiled["profile"]
    # item 2: with the cache, the checkpoint again reads nothing from its file; without it, all of it
    cache = {(r["side"], r["phase"]): r for r in got["rows"] if r["config"] == "cache"}
    mine, off = cache[("membackend", "first again")], cache[("keep_dropped off", "first again")]
    assert mine["equal"] is True and mine["from_file"] == 0 and mine["from_vram"] == off["from_file"] > 0, mine
    assert cache[("membackend", "other model")]["cached"] > 0 == cache[("keep_dropped off", "other model")]["cached"]
    assert [t["what"] for t in got["targets"]] == ["warm prompt (median) vs stock --cpu (ComfyUI's classic path)"]
    md = (out / "comfyui-gpu.md").read_text()
    assert "| default | warm | membackend |" in md and "| cache | first again | membackend |" in md
    assert md.strip() == p.stdout.strip()
