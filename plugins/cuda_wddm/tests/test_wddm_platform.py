"""The cuda_wddm Platform record: probe rule, its declared headroom setting, budget, and the mechanism it
asks for."""

from __future__ import annotations

import pytest

import membackend_cuda_wddm as wddm
from membackend._backends.vmm import VmmBackend
from membackend._drivers.sim import sim_driver
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.types import ConfigError, Device, DeviceInfo, Machine, Score

MiB, GiB = 1 << 20, 1 << 30
CUDA0 = Device("cuda", 0)


def machine(os="windows", *devices: DeviceInfo) -> Machine:
    return Machine(os=os, cpus=8, ram_total=32 * GiB, ram_available=32 * GiB, cgroup_limit=None,
                   torch_version=None, torch_vendor="cuda", devices=devices)


def gpu(index=0, vram=6 * GiB, model="wddm", kind="cuda", name="NVIDIA GeForce RTX 3050", vmm=True) -> DeviceInfo:
    return DeviceInfo(Device(kind, index), name, vram, driver_model=model, vmm_supported=vmm)


# ------------------------------------------------------------------ probe


def test_probe_fits_windows_wddm_in_the_platform_band_and_states_the_rule():
    c = wddm.probe(machine("windows", gpu()))
    assert c.name == "cuda_wddm" and c.score in Score.PLATFORM and not c.opt_in
    assert c.score == 84  # 96 - 2 x 6 GiB
    assert "96 - 2 per GiB" in c.reason and "6.0 GiB" in c.reason and "512 MiB headroom" in c.reason


def test_score_rises_as_vram_falls_and_stays_inside_the_band():
    sizes = [2, 4, 6, 8, 10, 12, 16, 24, 48]
    scores = [wddm.probe(machine("windows", gpu(vram=g * GiB))).score for g in sizes]
    assert scores == sorted(scores, reverse=True)
    assert scores[sizes.index(4)] > scores[sizes.index(6)] > scores[sizes.index(8)] > scores[sizes.index(12)]
    assert all(s in Score.PLATFORM for s in scores)
    assert min(scores) == wddm.SCORE_FLOOR and max(scores) == wddm.SCORE_TOP
    assert "meant for" in wddm.probe(machine("windows", gpu(vram=24 * GiB))).reason


def test_several_devices_score_by_the_smallest():
    c = wddm.probe(machine("windows", gpu(0, 24 * GiB), gpu(1, 8 * GiB, name="RTX 4060")))
    assert c.score == wddm.score_for(8 * GiB) and "cuda:1" in c.reason


@pytest.mark.parametrize("model, word", [("tcc", "TCC"), ("mcdm", "MCDM"), (None, "driver model unknown")])
def test_tcc_mcdm_or_unknown_driver_model_does_not_fit_and_names_the_device(model, word):
    c = wddm.probe(machine("windows", gpu(model=model, name="NVIDIA A4000")))
    assert c.score == Score.NONE
    assert word in c.reason and "cuda:0 (NVIDIA A4000)" in c.reason and "vmm" in c.reason


def test_a_tcc_device_next_to_a_wddm_one_does_not_fit():
    c = wddm.probe(machine("windows", gpu(0), gpu(1, 48 * GiB, "tcc", name="RTX A6000")))
    assert c.score == Score.NONE and "cuda:1 (RTX A6000): TCC" in c.reason


def test_not_windows_or_no_nvidia_device_does_not_fit():
    linux = wddm.probe(machine("linux", gpu(model=None)))
    assert linux.score == Score.NONE and "linux" in linux.reason
    amd = wddm.probe(machine("windows", gpu(kind="hip", model=None, name="AMD Radeon")))
    assert amd.score == Score.NONE and "no NVIDIA" in amd.reason
    assert wddm.probe(machine("windows")).score == Score.NONE


# ------------------------------------------------------------------ headroom: a setting the platform declares


def test_headroom_default_is_aimdo_s_512_mib_and_the_env_setting_changes_it(monkeypatch):
    assert wddm.headroom(6 * GiB) == wddm.DEFAULT_HEADROOM == 512 * MiB
    defaults = wddm.PLATFORM.setting_values()
    assert defaults["headroom"] == 512 * MiB and defaults.source("headroom") == "default"
    monkeypatch.setenv(wddm.HEADROOM_ENV, "1GiB")
    values = wddm.PLATFORM.setting_values()
    assert values["headroom"] == GiB and values.source("headroom") == "env MEMBACKEND_CUDA_WDDM_HEADROOM"
    assert wddm.headroom(6 * GiB, values) == wddm.PLATFORM.headroom_for(6 * GiB, values) == GiB
    monkeypatch.setenv(wddm.HEADROOM_ENV, "0")
    assert wddm.headroom(6 * GiB, wddm.PLATFORM.setting_values()) == 0
    assert wddm.PLATFORM.env_name("headroom") == wddm.HEADROOM_ENV


def test_the_headroom_setting_is_read_from_the_files_and_kwargs_under_the_platform_s_name(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.membackend.cuda_wddm]\nheadroom = "1GiB"\n')
    values = wddm.PLATFORM.setting_values()
    assert (values["headroom"], values.source("headroom")) == (GiB, "pyproject.toml [tool.membackend.cuda_wddm]")
    (tmp_path / "membackend.toml").write_text('[cuda_wddm]\nheadroom = "768MiB"\n')
    values = wddm.PLATFORM.setting_values()
    assert (values["headroom"], values.source("headroom")) == (768 * MiB, "membackend.toml [cuda_wddm]")
    monkeypatch.setenv(wddm.HEADROOM_ENV, "640MiB")
    assert wddm.PLATFORM.setting_values()["headroom"] == 640 * MiB  # env over the file
    values = wddm.PLATFORM.setting_values(load_settings(cuda_wddm={"headroom": "2GiB"}))
    assert (values["headroom"], values.source("headroom")) == (2 * GiB, "kwargs")  # kwargs over everything


def test_the_probe_names_the_headroom_in_force():
    values = wddm.PLATFORM.setting_values(load_settings(cuda_wddm={"headroom": "1GiB"}))
    assert "1024 MiB headroom" in wddm.PLATFORM.probe_for(machine("windows", gpu()), values).reason
    assert "512 MiB headroom" in wddm.PLATFORM.probe_for(machine("windows", gpu())).reason


@pytest.mark.parametrize("value", ["lots", "-5MiB", "1.5 parsecs"])
def test_a_headroom_that_is_not_a_size_is_a_config_error_naming_the_key(monkeypatch, value):
    monkeypatch.setenv(wddm.HEADROOM_ENV, value)
    with pytest.raises(ConfigError) as err:
        wddm.PLATFORM.setting_values()
    assert (err.value.key, err.value.source) == ("cuda_wddm.headroom", "env MEMBACKEND_CUDA_WDDM_HEADROOM")
    assert "is not a size" in str(err.value) and "MiB" in err.value.accepted


def test_a_key_the_platform_does_not_declare_is_refused_with_what_it_declares(tmp_path):
    (tmp_path / "membackend.toml").write_text("[cuda_wddm]\nhedroom = 1\n")
    with pytest.raises(ConfigError) as err:
        wddm.PLATFORM.setting_values()
    assert (err.value.key, err.value.source) == ("cuda_wddm.hedroom", "membackend.toml [cuda_wddm]")
    assert "unknown key" in str(err.value) and err.value.accepted == "one of: headroom"


def test_a_headroom_as_large_as_the_card_scores_zero_and_selection_goes_on(monkeypatch):
    """Refused at the probe, naming the key and its source: another backend is chosen, nothing fails later."""
    from membackend._drivers.open import machine_for

    monkeypatch.setenv(wddm.HEADROOM_ENV, "6GiB")
    settings = load_settings(sim_profile="wddm-6gb")
    selection = BackendManager(settings).select(machine_for(settings))
    c = selection.candidates["cuda_wddm"]
    assert c.score == 0 and "cuda_wddm.headroom (env MEMBACKEND_CUDA_WDDM_HEADROOM)" in c.reason, c
    assert "accepted: a size below" in c.reason and "cuda_wddm" not in selection.broken
    assert selection.record.name != "cuda_wddm"
    assert wddm.headroom(5 * GiB, wddm.PLATFORM.setting_values()) == 6 * GiB  # the rule itself never raises


def _session(**settings):
    return BackendManager(load_settings(sim_profile="wddm-6gb", **settings)).session()


def test_budget_is_the_dxgi_budget_minus_usage_minus_the_headroom(monkeypatch):
    s = _session()
    try:
        b = s.budget_query(CUDA0)
        dxgi = s.backend.driver.sim.wddm_budget(0)  # VRAM minus what the OS keeps
        assert s.backend.name == "cuda_wddm" and "DXGI" in b.source
        assert (b.total, b.free, b.headroom, b.usable) == (dxgi, dxgi, 512 * MiB, dxgi - 512 * MiB)
        assert s.headroom_in_force(CUDA0) == (512 * MiB, "platform cuda_wddm's own rule")
        r = s.reserve(CUDA0, 256 * MiB)
        s.fault(r, 0, 256 * MiB)
        assert s.budget_query(CUDA0).free == dxgi - 256 * MiB  # current usage counts against it
        monkeypatch.setenv(wddm.HEADROOM_ENV, "1GiB")  # read once, when the backend was built: no change
        assert s.budget_query(CUDA0).headroom == 512 * MiB
        s.set_headroom(CUDA0, GiB, source="live")  # a change while running goes through the session
        assert s.budget_query(CUDA0).headroom == GiB and s.headroom_in_force(CUDA0) == (GiB, "live")
    finally:
        s.close()


def test_the_env_setting_reaches_the_budget_through_the_platform(monkeypatch):
    monkeypatch.setenv(wddm.HEADROOM_ENV, "1GiB")
    s = _session()
    try:
        assert s.budget_query(CUDA0).headroom == GiB
        assert s.headroom_in_force(CUDA0) == (
            GiB, "platform cuda_wddm's own rule (cuda_wddm.headroom from env MEMBACKEND_CUDA_WDDM_HEADROOM)")
    finally:
        s.close()


def test_the_generic_headroom_setting_overrides_the_plugin_s(monkeypatch):
    monkeypatch.setenv(wddm.HEADROOM_ENV, "1GiB")
    s = _session(headroom=128 * MiB)
    try:
        assert s.budget_query(CUDA0).headroom == 128 * MiB
        assert s.headroom_in_force(CUDA0) == (128 * MiB, "start-up setting headroom (from kwargs)")
    finally:
        s.close()


def test_a_bad_headroom_is_a_settings_error_not_a_broken_plugin(monkeypatch):
    """Selecting another backend would quietly move the user off the plugin that prevents the bluescreen."""
    monkeypatch.setenv(wddm.HEADROOM_ENV, "lots")
    with pytest.raises(ConfigError, match=r"^cuda_wddm\.headroom \(from env MEMBACKEND_CUDA_WDDM_HEADROOM\): 'lots' "
                                          "is not a size"):
        BackendManager(load_settings(sim_profile="wddm-6gb"))


def test_the_doctor_shows_the_headroom_setting_with_its_source(monkeypatch, capsys):
    from membackend._cli import main

    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "wddm-6gb")
    monkeypatch.setenv(wddm.HEADROOM_ENV, "1GiB")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "cuda_wddm.headroom: 1GiB  [env MEMBACKEND_CUDA_WDDM_HEADROOM]" in out
    assert "headroom 1.0 GiB (platform cuda_wddm's own rule (cuda_wddm.headroom from env" in out


# ------------------------------------------------------------------ what the record asks of the mechanism


def test_the_record_asks_for_recycling_event_fences_and_release_on_unload():
    caps = wddm.PLATFORM.capabilities
    assert caps.recycle_handles and caps.release_on_full_unload and caps.fence_granularity == "reservation"
    assert wddm.PLATFORM.vendor == "cuda" and wddm.PLATFORM.budget_source == "wddm"


def test_a_freed_handle_is_mapped_again_and_trim_gives_every_one_back():
    backend = VmmBackend(wddm.PLATFORM, sim_driver("wddm-6gb"))
    from membackend._ledger import Ledger
    from membackend._session import Session

    s = Session(backend, machine=machine("windows", gpu()), ledger=Ledger())
    sim = backend.driver.sim
    r = s.reserve(CUDA0, 4 * backend.requested_page_size)
    s.fault(r, 0, r.size)
    created = sim.faults.calls["cuMemCreate"]
    s.free(r, 0, r.size)
    assert s.inspect(CUDA0).held == r.size and sim.faults.calls.get("cuMemRelease", 0) == 0
    f = s.fault(r, 0, r.size)
    assert f.ok and sim.faults.calls["cuMemCreate"] == created  # remapped, not created again
    s.release_reservation(r)
    assert s.trim(CUDA0) == r.size and s.inspect(CUDA0).held == 0
    assert sim.faults.calls["cuMemRelease"] == created and sim.state(0)["handles"] == 0
    s.close()


def test_a_free_waits_for_the_copy_event_before_unmapping():
    backend = VmmBackend(wddm.PLATFORM, sim_driver("wddm-6gb"))
    from membackend._ledger import Ledger
    from membackend._session import Session

    s = Session(backend, machine=machine("windows", gpu()), ledger=Ledger())
    d, sim = backend.driver, backend.driver.sim
    r = s.reserve(CUDA0, backend.requested_page_size)
    s.fault(r, 0, r.size)
    s.fence(CUDA0)  # the page-in is done; only the copy below is pending
    stream = d.stream_create()
    source = bytearray(r.size)  # the copy's host bytes (a real driver refuses NULL)
    d.memcpy_htod_async(r.base, source, r.size, stream)
    s.record(r, backend.fence_token(r, stream))
    assert sim.state(0)["pending_ops"] == 1
    s.free(r, 0, r.size)  # would be a SimulatedBugcheck without the wait
    assert sim.bugchecks == 0 and sim.state(0)["pending_ops"] == 0
    s.close()


def test_a_wddm_device_without_virtual_memory_management_does_not_fit():
    c = wddm.probe(machine("windows", gpu(vmm=False)))
    assert c.score == 0 and "does not support virtual memory management" in c.reason and "cuda:0" in c.reason
