"""Discovery, validation and selection through faked entry points."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import pytest

from membackend._machine import gather_machine
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.types import BackendDisabled, BackendNotFound, ConfigError

GROUP = "membackend.backends"


def ep(name, target):
    return EntryPoint(name, target, GROUP)


ALPHA = ep("alpha", "fakeplugins.backends:Alpha")
BETA = ep("beta", "fakeplugins.backends:Beta")
GAMMA = ep("gamma", "fakeplugins.backends:Gamma")
UNFIT = ep("unfit", "fakeplugins.backends:Unfit")
BROKEN = [
    ep("importer", "fakeplugins.broken_import:Anything"),
    ep("raiser", "fakeplugins.backends:RaisingProbe"),
    ep("badresult", "fakeplugins.backends:BadProbeResult"),
    ep("noverb", "fakeplugins.backends:MissingVerb"),
    ep("wrongsig", "fakeplugins.backends:WrongSignature"),
    ep("unmarked", "fakeplugins.backends:Unmarked"),
    ep("missing", "fakeplugins.nowhere:Nothing"),
]


def manager(eps, **settings):
    return BackendManager(load_settings(**settings), entry_points=eps)


def test_auto_picks_the_highest_score():
    sel = manager([ALPHA, GAMMA, UNFIT]).select()
    assert sel.record.name == "gamma" and sel.how == "auto"
    assert "gamma fits best" in sel.reason
    assert sel.candidates["unfit"].score == 0


def test_only_host_fits_means_fallback():
    sel = manager([UNFIT]).select()
    assert sel.record.name == "host" and sel.how == "fallback"
    assert "no other backend fits" in sel.reason


def test_forced_wins_over_a_higher_score():
    mgr = manager([ALPHA, GAMMA], backend="alpha")
    sel = mgr.select()
    assert sel.record.name == "alpha" and sel.how == "forced"
    session = mgr.session()
    assert session.name == "alpha" and session.how == "forced"


def test_forcing_the_host_works():
    assert manager([GAMMA], backend="host").select().record.name == "host"


def test_forcing_an_unfit_backend_is_refused_with_its_reason_unless_the_probe_is_overridden():
    with pytest.raises(BackendNotFound, match="backend 'unfit' cannot be used here: its probe says it does not fit "
                                              "this machine: needs a GB10 .*MEMBACKEND_OVERRIDE_PROBE=1"):
        manager([UNFIT], backend="unfit").select()
    sel = manager([UNFIT], backend="unfit", override_probe=True).select()
    assert sel.record.name == "unfit" and "(overridden by override_probe): needs a GB10" in sel.reason


def test_forced_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "alpha")
    assert manager([ALPHA, GAMMA]).select().record.name == "alpha"


def test_unknown_forced_name_says_so_in_one_line_with_what_is_installed():
    with pytest.raises(BackendNotFound) as info:
        manager([ALPHA, *BROKEN], backend="nope", block=["gamma"], machine={"devices": []}).select()
    err = info.value
    assert err.available == ["alpha", "host"]  # the built-in GPU backends serve no device of this machine
    assert str(err) == ("backend 'nope' is not installed (installed: aimdo, alpha, badresult, host, importer, "
                        "missing, noverb, raiser, unmarked, vmm, wrongsig); the name is from kwargs")
    assert "raiser" in err.unavailable and "probe raised RuntimeError" in err.unavailable["raiser"]
    assert "missing membackend_fence" in err.unavailable["noverb"]


@pytest.mark.parametrize("typed, meant", [("alhpa", "alpha"), ("gama", "gamma"), ("alpha_", "alpha")])
def test_a_misspelt_forced_name_gets_did_you_mean(typed, meant):
    with pytest.raises(BackendNotFound, match=f"^backend '{typed}' is not installed; did you mean {meant}\\? "):
        manager([ALPHA, GAMMA], backend=typed).select()


def _refused(target: str, name: str) -> str:
    """The one line ``BackendNotFound`` says when ``name`` (entry point ``target``) is forced on a machine
    without a GPU."""
    with pytest.raises(BackendNotFound) as info:
        manager([ep(name, target)], backend=name, machine={"devices": []}).select()
    return str(info.value)


def test_forcing_a_broken_backend_says_why():
    assert _refused("fakeplugins.backends:RaisingProbe", "raiser") == (
        "backend 'raiser' cannot be used here: broken: probe raised RuntimeError: driver exploded while probing; "
        "choices here: host; the name is from kwargs")


def test_forcing_a_backend_that_serves_no_device_here_gives_its_probes_reason():
    assert _refused("fakeplugins.backends:GpuOnly", "gpuonly") == (
        "backend 'gpuonly' cannot be used here: it serves cuda devices and this machine has none; its probe says: "
        "no CUDA device; choices here: host; the name is from kwargs")
    # with its device, its probe's "no" is refused too, unless override_probe says the user knows better
    gpu_machine = {"devices": [{"kind": "cuda", "total_memory": "8GiB"}]}
    with pytest.raises(BackendNotFound, match="its probe says it does not fit this machine: no CUDA device"):
        manager([ep("gpuonly", "fakeplugins.backends:GpuOnly")], backend="gpuonly", machine=gpu_machine).select()
    sel = manager([ep("gpuonly", "fakeplugins.backends:GpuOnly")], backend="gpuonly", machine=gpu_machine,
                  override_probe=True).select()
    assert sel.record.name == "gpuonly" and \
        "its probe says it does not fit (overridden by override_probe): no CUDA device" in sel.reason


def test_a_tie_is_broken_by_blocking_one():
    assert manager([ALPHA, BETA], block=["beta"]).select().record.name == "alpha"


def test_blocked_backend_is_never_selected_even_forced():
    sel = manager([ALPHA, GAMMA], block=["gamma"]).select()
    assert sel.record.name == "alpha" and sel.blocked == ["gamma"]
    with pytest.raises(BackendNotFound, match="^backend 'gamma' cannot be used here: blocked by MEMBACKEND_BLOCK; "):
        manager([ALPHA, GAMMA], block=["gamma"], backend="gamma").select()


def test_block_from_env_is_a_comma_list(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BLOCK", "gamma, alpha")
    sel = manager([ALPHA, GAMMA]).select()
    assert sel.record.name == "host" and sel.blocked == ["gamma", "alpha"]


def test_host_cannot_be_blocked():
    with pytest.raises(ConfigError, match="'host' is the fallback and cannot be blocked"):
        load_settings(block=["host"])


def test_broken_plugins_are_logged_and_skipped_never_fatal(caplog):
    caplog.set_level(logging.WARNING)
    mgr = manager([*BROKEN, ALPHA])
    sel = mgr.select()
    assert sel.record.name == "alpha"
    assert set(sel.broken) == {"importer", "raiser", "badresult", "noverb", "wrongsig", "unmarked", "missing"}
    assert "failed to load" in sel.broken["importer"] and "ImportError" in sel.broken["importer"]
    assert "should be membackend_fault(reservation, offset, size)" in sel.broken["wrongsig"]
    assert "not marked with membackend.hookimpl" in sel.broken["unmarked"]
    assert "probe must return a Candidate" in sel.broken["badresult"]
    assert "ModuleNotFoundError" in sel.broken["missing"]
    logged = caplog.text
    for name in sel.broken:
        assert f"backend {name} skipped" in logged


def test_duplicate_names_keep_the_first():
    mgr = manager([ALPHA, ep("alpha2", "fakeplugins.backends:Alpha")])
    assert mgr.records["alpha"].origin.startswith("entry point alpha =")
    assert any("already used" in why for why in mgr.broken.values())


def test_a_plugin_cannot_take_the_host_name():
    from membackend._backends.host import HostBackend

    class Impostor(HostBackend):
        pass

    mgr = BackendManager(load_settings(), builtins=[HostBackend(), Impostor()], entry_points=[])
    assert isinstance(mgr.records["host"].plugin, HostBackend) and len(mgr.broken) == 1


def test_plugins_built_from_settings_see_them():
    mgr = manager([ep("configured", "fakeplugins.backends:Configured")], headroom="1GiB")
    plugin = mgr.records["configured"].plugin
    assert plugin.seen_settings.headroom == 1 << 30


def test_version_comes_from_the_plugin():
    assert manager([ALPHA]).records["alpha"].version == "1.2.3"


def test_disable_switches_everything_off(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_DISABLE", "1")
    mgr = manager([GAMMA])
    sel = mgr.select()
    assert sel.record is None and sel.how == "disabled"
    with pytest.raises(BackendDisabled):
        mgr.session()


def test_real_entry_points_are_read_when_none_are_given():
    mgr = BackendManager(load_settings())
    assert "host" in mgr.records


def test_selection_uses_machine_overrides():
    from fakeplugins.backends import _Scored

    from membackend import hookimpl
    from membackend.types import Candidate

    class NeedsWddm(_Scored):
        name = "wddmonly"

        @hookimpl
        def membackend_probe(self, machine):
            wddm = [d for d in machine.gpus() if d.driver_model == "wddm"]
            return Candidate(self.name, 60 if wddm else 0, "WDDM GPU found" if wddm else "no WDDM GPU")

    settings = load_settings(machine={"os": "windows", "devices": [{"kind": "cuda", "total_memory": "6GiB",
                                                                    "driver_model": "wddm"}]})
    mgr = BackendManager(settings, builtins=None, entry_points=[])
    mgr._add(NeedsWddm(), "test", None)
    assert mgr.select(gather_machine(settings.machine)).record.name == "wddmonly"
    assert mgr.select(gather_machine()).record.name == "host"


# --------------------------------------------------------------------------- the score scale, isolation, probing once


def test_a_tie_at_the_top_never_stops_the_caller(caplog):
    mgr = manager([BETA, ALPHA])
    with caplog.at_level(logging.WARNING):
        sel = mgr.select()
        again = mgr.select()
    assert sel.record.name == again.record.name == "alpha", "ties go to the first name alphabetically"
    assert sel.tied == ["alpha", "beta"] and "tied with beta" in sel.reason
    warnings = [r for r in caplog.records if "tie with score 50" in r.getMessage()]
    assert len(warnings) == 1, "warned once"


def test_an_opt_in_backend_is_selected_only_when_forced():
    sel = manager([ep("optin", "fakeplugins.backends:OptIn")]).select()
    assert sel.record.name == "host" and sel.how == "fallback" and sel.candidates["optin"].opt_in
    assert not sel.tied, "an opt-in candidate never ties with anything"
    forced = manager([ep("optin", "fakeplugins.backends:OptIn")], backend="optin").select()
    assert forced.record.name == "optin" and forced.how == "forced"


def test_a_plugin_calling_sys_exit_in_its_probe_or_at_import_is_skipped():
    mgr = manager([ep("exiter", "fakeplugins.backends:ExitingProbe"),
                   ep("exitimport", "fakeplugins.exiting_import:Anything"), ALPHA])
    sel = mgr.select()
    assert sel.record.name == "alpha"
    assert "SystemExit" in sel.broken["exiter"] and "SystemExit" in sel.broken["exitimport"]


def test_a_hanging_probe_is_bounded_by_the_probe_timeout():
    from fakeplugins import backends as fake

    try:
        sel = manager([ep("hanger", "fakeplugins.backends:HangingProbe"), ALPHA], probe_timeout=0.2).select()
    finally:
        fake.HANG.set()
    assert sel.record.name == "alpha"
    assert "did not answer within 0.2 s" in sel.broken["hanger"]


def test_each_probe_runs_once_per_machine_even_for_the_doctor(monkeypatch, capsys):
    from fakeplugins import backends as fake

    from membackend import _cli as cli

    fake.PROBES["count"] = 0
    real = BackendManager.__init__

    def with_fake(self, settings=None, **kw):
        real(self, settings, entry_points=[ep("counted", "fakeplugins.backends:Counted")])

    monkeypatch.setattr(BackendManager, "__init__", with_fake)
    assert cli.main(["doctor"]) in (0, 1)
    assert fake.PROBES["count"] == 1


def test_a_platform_entry_point_becomes_a_vmm_backend_named_after_it():
    mgr = manager([ep("smallcard", "fakeplugins.platforms:PLATFORM")], sim_profile="wddm-6gb")
    from membackend._drivers.open import machine_for

    sel = mgr.select(machine_for(mgr.settings))
    rec = mgr.records["smallcard"]
    assert type(rec.plugin).__name__ == "VmmBackend" and rec.plugin.name == "smallcard"
    assert rec.plugin.capabilities.recycle_handles and rec.plugin.headroom == 64 << 20
    assert sel.record.name == "smallcard" and sel.candidates["smallcard"].score == 70
    assert sel.candidates["vmm"].score == 20, "the generic platform sits lower on the scale"


def test_an_unknown_simulation_profile_is_a_config_error_naming_the_profiles():
    with pytest.raises(ConfigError, match="sim_profile.*accepted: wddm-6gb, rocm-win-2gpu"):
        BackendManager(load_settings(sim_profile="nope"), entry_points=[])
