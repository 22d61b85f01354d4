"""``membackend doctor | backends | budget``: output, --json and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from membackend import _cli as cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_doctor_passes_its_self_test(capsys):
    code, out, _ = run(capsys, "doctor")
    assert code == 0
    assert "selected: host (fallback)" in out and "self-test: passed" in out
    assert "budgets:" in out and ("from psutil MemAvailable" in out or "cgroup" in out)
    for step in ("baseline", "reserve", "fault", "free", "release"):
        assert step in out


def test_doctor_json(capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    data = json.loads(out)
    assert code == 0 and data["selected"] == "host" and data["how"] == "fallback"
    assert data["selftest"]["ok"] and [s["step"] for s in data["selftest"]["steps"]] == [
        "baseline", "reserve", "fault", "free", "release"]
    fault = data["selftest"]["steps"][2]
    assert fault["rss"] - data["selftest"]["steps"][0]["rss"] >= 96 << 20
    assert data["machine"]["cpus"] >= 1 and data["budgets"][0]["device"] == "cpu:0"


def test_backends_and_budget(capsys):
    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0 and "host" in [b["name"] for b in json.loads(out)["backends"]]
    code, out, _ = run(capsys, "budget")
    assert code == 0 and "cpu:0: total" in out


def test_unknown_forced_backend_exits_2_with_the_choices(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "no_such_backend")
    code, _, err = run(capsys, "doctor")
    assert code == 2 and "backend 'no_such_backend' is not available; available: host" in err


def test_bad_setting_exits_2_naming_the_key(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_SANITIZE", "perhaps")
    code, _, err = run(capsys, "budget")
    assert code == 2 and "sanitize (from env MEMBACKEND_SANITIZE)" in err


def test_disabled_is_reported_not_an_error(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_DISABLE", "true")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "selected: none (disabled)" in out


def test_failed_self_test_exits_1(capsys, monkeypatch):
    # a host pool too small for the self-test's fault: the fault is out of memory
    monkeypatch.setenv("MEMBACKEND_HOST_CAPACITY", "1MiB")
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "0")
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "self-test: FAILED" in out


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "membackend._cli", "backends"], capture_output=True, text=True)
    assert proc.returncode == 0 and "host" in proc.stdout


def test_forcing_a_gpu_backend_on_a_machine_without_its_device_fails_the_self_test_cleanly(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "self-test: FAILED" in out and "no cuda device that 'vmm' serves was found here" in out


def test_a_gpu_backend_whose_driver_cannot_answer_fails_the_self_test_cleanly(capsys, monkeypatch):
    # the machine claims a CUDA device, but cuda-python finds no driver here
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", '[{"kind": "cuda", "total_memory": "8GiB"}]')
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "self-test: FAILED" in out and "budget query failed" in out


def test_doctor_prints_each_fact_with_its_source(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "gb10-128gb")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "selected: unified_gb10" in out
    assert "OS: linux  [sim:gb10-128gb: the simulated OS]" in out
    assert "integrated: yes  [cuda: cuDeviceGetAttribute(INTEGRATED)]" in out
    assert "virtual memory management: yes  [cuda: cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)]" in out
    assert "cuda (sim:gb10-128gb): 1 device(s), driver 13.0 (cuDriverGetVersion)" in out
    monkeypatch.setenv("MEMBACKEND_MACHINE__OS", "linux")
    code, out, _ = run(capsys, "doctor", "--json")
    machine = json.loads(out)["machine"]
    assert machine["sources"]["os"].startswith("user override MEMBACKEND_MACHINE__OS")
    assert machine["devices"][0]["sources"]["total_memory"] == "cuda: cuDeviceTotalMem"
    assert machine["discovery"] == ["cuda (sim:gb10-128gb): 1 device(s), driver 13.0 (cuDriverGetVersion)"]


def test_doctor_says_why_a_real_driver_listed_nothing(capsys):
    code, out, _ = run(capsys, "doctor")
    assert "discovery:" in out and "cuda" in out.split("discovery:")[1]
