"""Issue 42, round 6: the last traps of a first run -- forcing that leads to a failure, and words said twice
or in two units.

* the doctor's "to force another" names only backends whose probe accepts this machine, best first; comfy-aimdo
  (the real library, which drives the real driver) never claims a simulated GPU;
* a backend forced against its own probe is refused (exit 2) with the probe's reason and the documented way past
  it, ``override_probe``; with that set it is forced and the doctor says the probe was overridden;
* the doctor says a selection's reason once, the HIP runtime's absence once, and why the RSS column barely moves
  on a simulated GPU;
* the replay's tables, titles and pictures are all in GB, and its stock column is named for what it is.

Every case runs on a simulated machine; nothing here depends on timing.
"""

from __future__ import annotations

import json

import pytest
from test_round6_inputs import exits_2, run

from membackend._backends.aimdo import AimdoBackend
from membackend._drivers import discovery
from membackend._drivers.open import check_sim_profile
from membackend._drivers.sim.profiles import PROFILES
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.lab._pictures.layout import lay_out
from membackend.lab._replay.compare import replay
from membackend.lab._replay.scenarios import SCENARIOS
from membackend.types import BackendNotFound, ConfigError, Device, DeviceInfo, DriverError, Machine

FORCE_HINT = "  to force another: "


def _backends(monkeypatch, capsys, profile: str, **env: str) -> tuple[dict, str]:
    """``membackend backends`` on ``profile``: its JSON rows by name, and its text."""
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", profile)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, text, _ = run(capsys, "backends")
    assert code == 0, text
    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0
    return {r["name"]: r for r in json.loads(out)["backends"]}, text


def _offered(text: str) -> list[str]:
    """The names the "to force another" line offers, the first one named in the command first."""
    line = next((line for line in text.splitlines() if line.startswith(FORCE_HINT)), None)
    return [] if line is None else line.split("choices: ")[1].split(", ")


# --------------------------------------------------------------------------- what the doctor offers to force


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_force_hint_offers_only_backends_whose_probe_accepts_the_machine_best_first(monkeypatch, capsys, profile):
    rows, text = _backends(monkeypatch, capsys, profile)
    offered = _offered(text)
    assert all(rows[n]["score"] > 0 for n in offered), (profile, offered, {n: rows[n]["score"] for n in offered})
    scores = [rows[n]["score"] for n in offered]
    assert scores == sorted(scores, reverse=True), (profile, offered)
    assert "aimdo" not in offered  # the real library cannot drive a simulated GPU


def test_gfx1150_apu_offers_nothing_to_force_and_says_how_to_override(monkeypatch, capsys):
    _, text = _backends(monkeypatch, capsys, "gfx1150-apu")
    assert _offered(text) == []
    assert "  to force one whose probe turned it down: MEMBACKEND_BACKEND=<name> with MEMBACKEND_OVERRIDE_PROBE=1" \
        in text.splitlines()


def test_strix_halo_never_offers_the_windows_plugin(monkeypatch, capsys):
    pytest.importorskip("membackend_rocm_windows")
    _, text = _backends(monkeypatch, capsys, "strix-halo-128gb")
    assert "rocm_windows" not in _offered(text) and _offered(text)[0] == "vmm"


def test_aimdo_does_not_claim_a_simulated_gpu():
    machine = Machine(os="linux", cpus=2, ram_total=16 << 30, ram_available=8 << 30, cgroup_limit=None,
                      torch_version=None, torch_vendor=None,
                      devices=(DeviceInfo(Device("cuda", 0), "NVIDIA H200", 8 << 30, vmm_supported=True,
                                          source="sim:h200"),))
    c = AimdoBackend().membackend_probe(machine=machine)
    assert c.score == 0 and c.reason.startswith("cuda:0 is simulated (sim:h200)"), c


# --------------------------------------------------------------------------- forcing against the probe


@pytest.mark.parametrize("profile, backend, says", [
    ("gfx1150-apu", "vmm", "hip:0 (AMD Radeon 890M Graphics) does not support virtual memory management"),
    ("h200", "unified_gb10", "cuda:0 NVIDIA H200 is not integrated"),
])
def test_a_backend_forced_against_its_probe_exits_2_with_the_probe_reason(monkeypatch, capsys, profile, backend,
                                                                         says):
    if backend == "unified_gb10":
        pytest.importorskip("membackend_unified_gb10")
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", profile)
    monkeypatch.setenv("MEMBACKEND_BACKEND", backend)
    for command in ("doctor", "backends"):
        line = exits_2(capsys, command)
        assert line.startswith(f"membackend: configuration error: backend {backend!r} cannot be used here: its probe "
                               f"says it does not fit this machine: "), line
        assert says in line and "set MEMBACKEND_OVERRIDE_PROBE=1" in line
        assert line.endswith("the name is from env MEMBACKEND_BACKEND"), line
    with pytest.raises(BackendNotFound):
        BackendManager(load_settings()).select()


def test_override_probe_forces_it_and_the_doctor_says_so(monkeypatch, capsys):
    rows, text = _backends(monkeypatch, capsys, "gfx1150-apu", MEMBACKEND_BACKEND="vmm", MEMBACKEND_OVERRIDE_PROBE="1")
    assert rows["vmm"]["selected"] and rows["vmm"]["score"] == 0
    assert "selected: vmm (forced): forced by backend='vmm'; its probe says it does not fit (overridden by " \
           "override_probe): its probe's reason, above" in text
    assert load_settings().source_of("override_probe") == "env MEMBACKEND_OVERRIDE_PROBE"


def test_override_probe_is_a_flag_and_refuses_anything_else(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_OVERRIDE_PROBE", "please")
    with pytest.raises(ConfigError, match="override_probe .from env MEMBACKEND_OVERRIDE_PROBE.: 'please'"):
        load_settings()


def test_the_conformance_kit_still_forces_a_backend_on_any_machine():
    """The kit (``anywhere``) tests a backend where its probe says no: its rules skip and say why."""
    sel = BackendManager(load_settings(backend="vmm", sim_profile="gfx1150-apu")).select(anywhere=True)
    assert sel.record.name == "vmm" and sel.how == "forced"


# --------------------------------------------------------------------------- said once, and why


def test_the_selection_reason_is_printed_once(monkeypatch, capsys):
    pytest.importorskip("membackend_rocm_linux")
    rows, text = _backends(monkeypatch, capsys, "strix-halo-128gb")
    reason = rows["rocm_linux"]["reason"]
    assert len(reason) > 200 and text.count(reason) == 1
    assert "selected: rocm_linux (auto): highest probe score (70): its probe's reason, above" in text


def test_a_missing_hip_runtime_is_said_once():
    def hip_python():
        raise DriverError("unavailable", "dlopen", "libamdhip64.so is not on the library search path; hip-python "
                                                   "not asked")

    def ctypes_runtime():
        raise DriverError("unavailable", "dlopen", "no HIP runtime library found; tried libamdhip64.so")

    devices, notes = discovery._hip([hip_python, ctypes_runtime], "linux")
    assert devices == [] and notes == ["hip: dlopen failed with unavailable: no HIP runtime library found; tried "
                                       "libamdhip64.so"], notes


def test_the_doctor_says_why_rss_barely_moves_on_a_simulated_gpu(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "h200")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "  (RSS is this process's own resident memory: the bytes of a GPU simulated by sim:h200 " \
                          "are pages of a memfd" in out
    monkeypatch.delenv("MEMBACKEND_SIM_PROFILE")
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "RSS is this process's own" not in out  # the host backend's pages are this process's


def test_an_unknown_profile_checked_anywhere_gets_the_closest_name():
    with pytest.raises(ConfigError, match="unknown simulation profile 'H20'; did you mean h200\\?") as info:
        check_sim_profile("H20")
    assert info.value.accepted == ", ".join(PROFILES)


# --------------------------------------------------------------------------- the replay, in one unit


def test_replay_tables_titles_and_pictures_are_in_gb_and_name_the_stock_side():
    for scenario in SCENARIOS.values():
        assert "GiB" not in scenario.title, scenario.title
    comparison = replay("hook-unload", seeds=1)
    table = comparison.table()
    labels = [line[:48] for line in table.splitlines()]
    assert not any("GiB" in label for label in labels), table
    assert "resident after the owner's unload (GB)*" in table and "stock (comfy-aimdo)" in table
    assert "aimdo_stock" not in table
    summaries = [line for panel in lay_out(comparison.timelines()).all_panels() for line in panel.summary]
    assert any(line.startswith("at the end: ") and line.endswith(" GB") for line in summaries), summaries
