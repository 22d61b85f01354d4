"""The adapter inside a stand-in ComfyUI (tests/fixtures/comfyui_standin): installed with the real
``membackend comfyui install``, booted in main.py's order, weights as real torch tensors over
host-backend reservations, every check numerical. Each scenario runs in its own process (ComfyUI's
modules are process-global); they run four at a time.

Only what the real tree cannot show on this machine stays here (docs/real-comfyui-tests.md lists which is
which): GPU streams and the fences recorded on them (G2 races), pinned host registration and aimdo's cast
buffer, faults injected into each patch, a dropped model's reservation returned at once, the idle hook, a trace replayed,
comfy-aimdo without a name, and the flags that keep dynamic VRAM off. The weights, the seed reports and the
disabled adapter run in the real ComfyUI tree (tests/real_comfyui/test_weights.py, test_seeds.py,
test_served.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("comfy_aimdo")

from membackend._cli import main as cli  # noqa: E402

#: 17 processes each booting the stand-in ComfyUI with torch (about 30 s): the long part
pytestmark = pytest.mark.long

STANDIN = Path(__file__).parent / "fixtures" / "comfyui_standin"
MiB = 1 << 20
# --enable-dynamic-vram: this stand-in's device has no CUDA, so (as in ComfyUI) only the flag starts dynamic VRAM
HOST = {"MEMBACKEND_BACKEND": "host", "MEMBACKEND_HEADROOM": "0", "MEMBACKEND_HOST_CAPACITY": "256MiB",
        "STANDIN_ARGS": "--enable-dynamic-vram"}

SCENARIOS = {  # name: (argv, environment); each is one process booting the stand-in
    "host": (["basic,status,buffers"], HOST),
    "dropped": (["dropped"], HOST),
    "switch_tight": (["switch"], {**HOST, "STANDIN_EXTRA": "0", "MEMBACKEND_HOST_CAPACITY": "8MiB"}),  # a trace
    "old_aimdo": (["old_aimdo"], HOST),
    # ComfyUI's flags that exclude --cpu: the decision follows main.py's (the stand-in's main.py follows it)
    **{f"flag_{f}": (["stock"], {**HOST, "STANDIN_ARGS": f"--{f}"}) for f in ("highvram", "gpu-only", "novram")},
    "flag_lowvram": (["basic"], {**HOST, "STANDIN_ARGS": "--enable-dynamic-vram --lowvram"}),
    **{f"inject_{w}": (["inject", w], HOST) for w in ("budget", "fault", "unload")},
    **{f"race_{m}": (["race", m], HOST) for m in ("record", "norecord")},
    "idle": (["idle", "spy"], HOST),
    "inject_idle": (["idle", "inject"], HOST),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy")
    installed = base / "installed"
    shutil.copytree(STANDIN, installed)
    assert cli(["comfyui", "install", str(installed)]) == 0

    def run(item):
        name, (argv, env) = item
        root = installed
        trace = base / f"{name}.jsonl"
        full = {k: v for k, v in os.environ.items() if not k.startswith(("MEMBACKEND_", "STANDIN_"))}
        full.update(env, MEMBACKEND_TRACE=str(trace), PYTHONPATH=str(Path(__file__).parents[1]))
        p = subprocess.run([sys.executable, str(root / "scenario.py"), *argv], capture_output=True, text=True,
                           env=full, cwd=str(base), timeout=300)
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        lines = [ln for ln in p.stderr.splitlines() if "membackend" in ln]
        events = [json.loads(ln) for ln in trace.read_text().splitlines()] if trace.exists() else []
        found = json.loads(p.stdout.strip().splitlines()[-1])
        common = {k: found.pop(k) for k in ("dynamic", "patcher")}
        parts = {k: {**common, **v} for k, v in found.items()}
        return name, {"out": parts[argv[0].split(",")[0]], "parts": parts, "log": lines, "trace": events}

    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(run, SCENARIOS.items()))


def test_start_up_prints_one_line_naming_the_backend_why_and_how_to_change_it(results):
    log = results["host"]["log"]
    first = [ln for ln in log if "using host" in ln]
    assert len(first) == 1 and len(first[0]) <= 200
    assert "forced" in first[0] and "MEMBACKEND_BACKEND=<name>" in first[0] and "MEMBACKEND_DISABLE=1" in first[0]
    out = results["host"]["parts"]["basic"]
    assert out["dynamic"] and out["patcher"] == "ModelPatcherDynamic"


def test_status_route_reports_backend_budgets_reservations_and_models(results):
    out = results["host"]["parts"]["status"]
    st = out["status"]
    assert st["running"] and st["backend"] == "host" and st["budgets"]["cpu:0"]["total"] == 256 * MiB
    # the basic part's model is still held warm (G4): one reservation per model, each resident
    assert len(st["reservations"]) == len(st["models"]) >= 1
    assert all(m["resident"] > 0 for m in st["models"].values())
    assert out["patches_survive_hook_breaker"]


def test_an_old_comfy_aimdo_without_a_replaced_name_leaves_comfyui_stock(results):
    r = results["old_aimdo"]
    assert r["out"]["patcher"] == "ModelPatcher" and r["out"]["correct"] and r["out"]["patched"] == []
    assert any("switched off while starting" in ln and "vbars_analyze" in ln for ln in r["log"])


@pytest.mark.parametrize("where", ["budget", "fault", "unload"])
def test_an_exception_in_a_patch_switches_the_adapter_off_and_comfyui_carries_on(results, where):
    r = results[f"inject_{where}"]
    out = r["out"]
    assert out["aborted"] and "injected" in out["aborted"] and out["running"] is False
    assert out["free_memory_restored"] and out["patcher_after"] == "ModelPatcher"
    assert out["video_correct"] and out["image_equal"]
    assert len([ln for ln in r["log"] if "switched off" in ln]) == 1


def test_g2_a_free_racing_a_queued_cast_copy_waits_for_it_and_outputs_stay_right(results):
    """The cast path queues the copy on its offload stream and unpins before it ran (as on a GPU); a
    full unload on another thread then waits on the token recorded at the unpin: the copy lands first,
    the outputs equal the first run's."""
    out = results["race_record"]["out"]
    # the copy held at the gate lands before the free returns (the run's later copies may come either side)
    assert out["free_waited"] and out["order"][0] == "copy" and "free" in out["order"] and out["tokens_recorded"] >= 1
    assert out["equal"] and out["correct"] and out["alive_after"] == 1


def test_g2_without_the_recorded_token_the_race_test_catches_the_free_not_waiting(results):
    """The same race with recording switched off: the free returns while the copy is still queued (it
    would write into freed pages), which is what the test above would then fail on."""
    out = results["race_norecord"]["out"]
    assert out["tokens_recorded"] == 0
    assert out["free_waited"] is False and out["free_returned_before_copy"] is True


def test_aimdos_cast_buffer_host_buffer_and_file_map_call_sites_run_on_membackend(results):
    """get_aimdo_cast_buffer (VRAMBuffer), pinned_memory (HostBuffer + hostbuf_to_tensor) and the
    safetensors load (ModelMMAP) with aimdo holding no device: served by membackend, bytes exact."""
    out = results["host"]["parts"]["buffers"]
    ours = "membackend._comfyui.buffers"
    assert out["cast_buffer"] == [ours, True] and out["host_buffer"] == [ours, True, 64]
    assert out["mmap"] == [ours, True] and out["read_file_slice"] is True


def test_a_model_comfyui_holds_stays_warm_and_one_it_dropped_goes_at_once(results):
    """Issue 34, item 4: membackend keeps no model alive. On a workflow switch ComfyUI drops the video model
    and still holds the image model: the video model is collected and its reservation returned at once (by
    the reaper thread, no node has to run), and the image model is still warm (G4: nothing copied, same
    output)."""
    r = results["dropped"]
    out = r["out"]
    assert out["alive"] == {"image": True, "video": False}
    assert out["reservations_before"] == 2 and out["reservations_after"] == 1 and out["dropped"] == 1
    assert out["held"] == 1
    assert out["warm_equal"] and out["warm_copied"] == 0
    assert any("dropped by ComfyUI" in ln and "1 reservation(s)" in ln for ln in r["log"])


def test_on_idle_runs_when_the_prompt_queue_empties_and_never_during_a_run(results):
    """main.prompt_worker with p1 and p2 queued, then p3: the queue empties after p2 and after p3, and only
    then does the adapter call ResidencyManager.on_idle (not after p1, with p2 still queued; never
    between a prompt's start and its end). ComfyUI's own task_done ran once per prompt, with its
    arguments (process_item dropped the sensitive element)."""
    r = results["idle"]
    out = r["out"]
    assert out["settled_first"] and out["settled_second"]
    assert out["order"] == ["run p1", "ran p1", "run p2", "ran p2", "idle", "run p3", "ran p3", "idle"]
    assert out["idles"] == 2 and out["aborted"] is None and out["task_done_patched"]
    assert out["outputs"] == {"p1": True, "p2": True, "p3": True}
    assert out["history"] == ["p1", "p2", "p3"] and out["statuses"] == ["success"] * 3
    assert out["sensitive_kept"] == [5, 5, 5]
    assert [e["event"] for e in r["trace"]].count("idle") == 2


def test_an_exception_in_the_idle_patch_restores_everything_and_the_queue_carries_on_stock(results):
    """on_idle raising at the first empty queue: the adapter switches off (task_done and every wiring patch
    restored, legacy patcher for new models), ComfyUI's own task_done is not run twice, and the next
    prompt runs and is recorded as ComfyUI would."""
    r = results["inject_idle"]
    out = r["out"]
    assert out["settled_first"] and out["settled_second"]
    assert out["order"] == ["run p1", "ran p1", "run p2", "ran p2", "idle", "run p3", "ran p3"]
    assert "injected into on_idle" in out["aborted"] and out["running"] is False
    assert not out["task_done_patched"] and out["free_memory_restored"] and out["patcher_after"] == "ModelPatcher"
    assert out["outputs"] == {"p1": True, "p2": True, "p3": True}
    assert out["history"] == ["p1", "p2", "p3"] and out["statuses"] == ["success"] * 3
    assert len([ln for ln in r["log"] if "switched off" in ln]) == 1


def test_a_trace_recorded_inside_comfyui_replays_on_a_simulated_gpu(results, tmp_path):
    """MEMBACKEND_TRACE inside ComfyUI records what a replay needs, copies with their durations
    included; the file replays on another (simulated) machine."""
    from membackend.lab._replay.compare import replay

    events = results["switch_tight"]["trace"]
    copies = [e for e in events if e["event"] == "copy"]
    assert copies and all(e["seconds"] >= 0 and e["bytes"] > 0 for e in copies)
    path = tmp_path / "comfyui.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    c = replay(str(path), profile="h200")
    plugin = c.results["plugin"][0]
    assert plugin.loaded > 0 and c.violations == [], c.table()
    assert "cpu:0 replayed on cuda:0" in c.table()


@pytest.mark.parametrize("flag", ["highvram", "gpu-only", "novram"])
def test_comfyuis_flags_that_switch_dynamic_vram_off_leave_it_stock_and_say_which(results, flag):
    r = results[f"flag_{flag}"]
    assert r["out"]["patcher"] == "ModelPatcher" and r["out"]["patched"] == [] and r["out"]["vbar_is_aimdo"]
    assert r["out"]["correct"]
    lines = [ln for ln in r["log"] if "membackend 0" in ln]
    assert len(lines) == 1 and f"its dynamic VRAM is off (--{flag})" in lines[0]


def test_lowvram_changes_nothing_under_dynamic_vram(results):
    out = results["flag_lowvram"]["out"]
    assert out["patcher"] == "ModelPatcherDynamic" and out["correct"] and out["second_copied"] == 0
    assert any("using host" in ln for ln in results["flag_lowvram"]["log"])
