"""scripts/gpu-check (benchmarks/bench_gpu.py) without a GPU: the skip without a device, and the JSON
it prints with one, over a simulated H200 driver (the same code the real cuda-python wrapper runs;
no timing is asserted, only the shape and the outcomes the simulation can decide)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
CHECK = ROOT / "benchmarks" / "bench_gpu.py"
MiB = 1 << 20


def _load():
    spec = importlib.util.spec_from_file_location("membackend_bench_gpu", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_skip_line(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    data = json.loads(lines[0])
    assert set(data) == {"skipped"} and data["skipped"].startswith("no CUDA device ("), data
    return data["skipped"]


@pytest.mark.skipif(sys.platform == "win32", reason="scripts/gpu-check is a bash script")
def test_without_a_device_the_script_prints_one_skipped_line_and_exits_0():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a machine with a GPU hides it: cuInit says CUDA_ERROR_NO_DEVICE
    env["PYTHON"] = sys.executable
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    why = _one_skip_line(p.stdout)
    assert "CUDA_VISIBLE_DEVICES=''" in why or "cannot be loaded" in why, why


def test_the_skip_needs_nothing_but_the_standard_library():
    """-S: no site-packages at all (no membackend dependencies, no cuda-python, no torch)."""
    p = subprocess.run([sys.executable, "-S", str(CHECK), "--libcuda", "/nonexistent/libcuda.so.1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "/nonexistent/libcuda.so.1 cannot be loaded" in _one_skip_line(p.stdout)


def test_the_script_installs_and_downloads_nothing_and_states_its_time():
    text = SCRIPT.read_text()
    commands = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    words = {w for c in commands for w in c.replace(";", " ").split()}
    assert not words & {"pip", "pip3", "install", "scripts/setup", "curl", "wget", "uv"}, commands
    assert "about a minute" in text and "timeout 300" in text
    assert _load().EXPECTED_SECONDS == 60


@pytest.fixture
def report():
    pytest.importorskip("cuda.bindings.driver")  # the simulated driver uses cuda-python's types
    from membackend._drivers.open import open_gpu_driver

    check = _load()
    return check.run(open_gpu_driver("cuda", "h200"), total=64 * MiB, reps=1, use_torch=False, aimdo=False)


def test_the_report_has_every_part_and_is_json(report):
    assert set(report) == {"expected_seconds", "device", "fault_copy", "free_latency", "g1_release", "budget",
                           "g2_fence", "torch_device", "aimdo", "seconds"}
    json.loads(json.dumps(report))  # plain JSON values only
    assert report["device"]["name"] == "NVIDIA H200" and report["device"]["total_bytes"] > 0
    for part in ("fault_copy", "free_latency", "g1_release", "budget", "g2_fence"):
        assert "error" not in report[part], report[part]
    assert set(report["fault_copy"]) == {"2MiB", "32MiB"}
    for label, page in (("2MiB", 2 * MiB), ("32MiB", 32 * MiB)):
        fc = report["fault_copy"][label]
        assert "error" not in fc, fc
        assert fc["page_bytes"] == page and fc["pages"] * page == fc["bytes"] == 64 * MiB
        for key in ("plain_copy_GBps", "fault_copy_GBps", "fault_copy_ratio", "map_us_per_page", "unmap_us_per_page"):
            assert isinstance(fc[key], float) and fc[key] > 0, (label, key, fc)
    for label in ("with_sync", "without_sync"):
        fl = report["free_latency"][label]
        assert {"free_ms", "in_flight_ms", "in_flight_bytes"} <= set(fl) and fl["free_ms"] >= 0, fl
    g1 = report["g1_release"]
    assert g1["ok"] and g1["taken_by_fault"] == g1["returned_by_release"] == 64 * MiB, g1
    assert g1["free_after_release"] == g1["free_before"] and g1["reserved_again_backed"]
    g2 = report["g2_fence"]
    assert g2["ok"] and g2["copies"]["error_after"] is None and set(g2["kernel"]) == {"skipped"}, g2
    budget = report["budget"]
    assert budget["session"]["source"].startswith("cuMemGetInfo") and budget["totals_agree"], budget
    assert budget["cuMemGetInfo_free_minus_session_free"] == 0 and "skipped" in budget["torch_mem_get_info"]
    # without torch: said why; the thread's CUDA context is what it was before membackend ran
    assert "skipped" in report["torch_device"] and report["torch_device"]["thread_context_unchanged"] is True
    assert report["aimdo"] == {"skipped": "not asked (--no-aimdo)"}
    assert isinstance(report["seconds"], float)


def test_a_cpu_torch_is_named_as_the_reason_the_torch_parts_are_skipped():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here")
    torch_mod, why = _load()._torch_or_reason()
    assert torch_mod is None and torch.__version__ in why and "CPU build" in why, why


def test_a_missing_comfy_aimdo_or_a_failing_child_is_reported_not_raised(monkeypatch):
    check = _load()
    pytest.importorskip("comfy_aimdo")
    bad = [sys.executable, "-c", "import sys; print('no json'); sys.exit(3)"]
    assert check._aimdo(0, 64 * MiB, 1, bad)["error"].startswith("the aimdo run exited 3")
    good = [sys.executable, "-c", "import json; print(json.dumps({'fault_copy': {}, 'free_latency': {}}))"]
    assert check._aimdo(0, 64 * MiB, 1, good) == {"fault_copy": {}, "free_latency": {}}


# ---------------------------------------------------------------------------------------------- the ComfyUI check

COMFYUI_CHECK = ROOT / "benchmarks" / "bench_comfyui_gpu.py"


def test_the_comfyui_check_without_a_device_prints_one_skipped_line_and_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    p = subprocess.run([sys.executable, str(COMFYUI_CHECK), "--tree", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    _one_skip_line(p.stdout)


def test_the_stand_ins_give_comfyui_the_names_it_reads_at_start_up(tmp_path):
    spec = importlib.util.spec_from_file_location("membackend_bench_comfyui_gpu", COMFYUI_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    module.write_standins(tmp_path, ["comfy_kitchen", "av"])
    code = ("import comfy_kitchen, av\n"
            "from av.container import InputContainer\n"
            "from av.subtitles.stream import SubtitleStream\n"
            "from av.video.reformatter import ColorRange\n"
            "assert comfy_kitchen.int8_attention_is_available() is False\n"
            "assert comfy_kitchen.flash_attention_decode_is_available('cuda') is False\n"
            "assert isinstance(av.VideoStream, type) and ColorRange.JPEG != ColorRange.MPEG\n"
            "try:\n    from comfy_kitchen.tensor import QuantizedTensor\nexcept ImportError:\n    print('no tensor')\n")
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 0 and p.stdout.strip() == "no tensor", p.stderr  # quant_ops.py catches the ImportError


def test_the_script_runs_the_comfyui_check_only_when_asked_and_bounds_it():
    text = SCRIPT.read_text()
    assert "--comfyui)" in text and "timeout 420" in text and "bench_comfyui_gpu.py" in text


def test_help_names_the_scripts_own_options_and_the_driver_checks():
    p = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "--comfyui TREE" in p.stdout and "--with-tests" in p.stdout, p.stdout
    assert "--device" in p.stdout, "the driver check's own options follow"
    assert "{\"skipped\"" not in p.stdout.splitlines()[0], "help runs no check"


def test_the_comfyui_checks_targets_come_from_the_rows_that_are_there():
    spec = importlib.util.spec_from_file_location("membackend_bench_comfyui_gpu", COMFYUI_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def row(config, side, phase, seconds):
        return {"config": config, "side": side, "phase": phase, "seconds": seconds}

    rows = [row("default", "stock", "warm", 1.41), row("default", "membackend", "warm", 0.98),
            row("no dynamic", "stock", "warm", 0.96), row("default", "stock", "first again", 2.76),
            row("default", "membackend", "first again", 2.0)]
    got = {t["what"]: (t["ratio"], t["target"]) for t in module.targets(rows, standin=False)}
    assert got["warm prompt (median) vs stock --disable-dynamic-vram"] == (round(0.98 / 0.96, 3), 1.05)
    assert got["warm prompt (median) vs stock dynamic"] == (round(0.98 / 1.41, 3), 0.75)
    assert got["first model again vs stock dynamic"] == (round(2.0 / 2.76, 3), 0.8)
    assert not any(w.startswith("cap") for w in got), "no cap rows: no cap target"
    standin = module.targets(rows, standin=True)
    assert [t["what"] for t in standin] == ["warm prompt (median) vs stock --cpu (ComfyUI's classic path)"]
