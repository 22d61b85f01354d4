"""Issue 42, "Nothing lost", round 6: inputs that were refused wrongly, or not at all.

* a path that cannot even be looked up (a part over 255 bytes, a folder this user may not search) is a
  typed error in one line, exit 2 in the command line -- not a bare ``OSError`` and a traceback;
* one variable set in two spellings with different values is refused, naming both;
* simulated profiles match in any case, and an unknown one gets the closest name and every profile's,
  from the profile table itself;
* what a refusal echoes is cut short and quoted (an empty name, a newline);
* typos get the right advice: the closest installed name, never an install hint for a package that does not
  exist; ``CUDA_WDDM`` is ``cuda_wddm``; a typo in ``membackend.toml`` names the file;
* a bad value of a setting a platform plugin declares, and a ``host_capacity`` above the RAM, are settings
  errors (exit 2), not a broken plugin and a self-test that fails.

Every case runs on a simulated machine or on the host; nothing here depends on this machine's RAM (the RAM
the host backend sees is set where it matters) or on timing.
"""

from __future__ import annotations

import errno
import logging
import os
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import membackend
from membackend import _cli as cli
from membackend._backends import host as host_backend
from membackend._comfyui.install import NotComfyUI, install
from membackend._drivers.sim.profiles import PROFILES, get_profile
from membackend._hostmem import HostMemory
from membackend._manager import BackendManager
from membackend._settings import load_settings, quick_settings
from membackend._settings.rules import did_you_mean, shown
from membackend.lab import PluginMissing, ReplayError
from membackend.lab._replay.compare import replay
from membackend.platform import Platform, PlatformSetting, size
from membackend.types import ConfigError

GiB = 1 << 30
LONG_PART = "a" * 256  # one more byte than a path component may have on most file systems (NAME_MAX 255)
HUGE = "b" * 100_000
GROUP = "membackend.backends"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def exits_2(capsys, *argv: str) -> str:
    """The command exits 2 with one line on stderr, no traceback, nothing on stdout; that line."""
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and out == "", (code, out, err)
    return lines[0]


def one_line(exc: BaseException, most: int = 1000) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) <= most, text[:2000]
    return text


# --------------------------------------------------------------------------- item 4: paths that cannot be looked up


def test_a_config_path_with_a_part_over_255_bytes_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path / LONG_PART / "membackend.toml"))
    for read in (load_settings, quick_settings, lambda: membackend.create_session(sim_profile="h200")):
        with pytest.raises(ConfigError) as info:
            read()
        assert (info.value.key, info.value.source) == ("config", "env MEMBACKEND_CONFIG")
        assert "File name too long" in one_line(info.value) and "characters in all" in str(info.value)


def test_doctor_with_such_a_config_path_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path / LONG_PART / "membackend.toml"))
    line = exits_2(capsys, "doctor")
    assert line.startswith("membackend: configuration error: config (from env MEMBACKEND_CONFIG): ")
    assert "File name too long" in line and "accepted: " in line


def test_comfyui_install_into_a_folder_with_a_part_over_255_bytes_is_refused(tmp_path, capsys):
    folder = tmp_path / LONG_PART
    with pytest.raises(NotComfyUI, match="cannot be looked up: File name too long"):
        install(folder)
    line = exits_2(capsys, "comfyui", "install", str(folder))
    assert "File name too long" in line and "nothing was changed" in line and "accepted: " in line


def _searching_refused(monkeypatch, folder: Path) -> None:
    """``os.stat`` of anything under ``folder`` fails with EACCES, as for a folder this user may not search
    (chmod 000 cannot show it to root, who may search everything)."""
    real = os.stat
    inside = str(folder) + os.sep

    def stat(path, *args, **kwargs):
        if os.fspath(path).startswith(inside):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "stat", stat)


def test_a_config_file_in_a_folder_that_cannot_be_searched_is_a_config_error(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(locked / "membackend.toml"))
    _searching_refused(monkeypatch, locked)
    with pytest.raises(ConfigError, match=r"cannot be looked up: Permission denied") as info:
        load_settings()
    assert info.value.key == "config" and one_line(info.value)
    assert "Permission denied" in exits_2(capsys, "doctor")


def test_comfyui_install_into_a_folder_that_cannot_be_searched_is_refused(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    comfy = locked / "ComfyUI"
    _searching_refused(monkeypatch, locked)
    with pytest.raises(NotComfyUI, match="cannot be looked up: Permission denied"):
        install(comfy)
    assert "Permission denied" in exits_2(capsys, "comfyui", "install", str(comfy))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may search any folder: chmod 000 cannot refuse it (the simulated case above runs)")
def test_a_real_folder_that_cannot_be_searched(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    (locked / "ComfyUI").mkdir(parents=True)
    locked.chmod(0)
    try:
        monkeypatch.setenv("MEMBACKEND_CONFIG", str(locked / "membackend.toml"))
        assert "Permission denied" in exits_2(capsys, "doctor")
        assert "Permission denied" in exits_2(capsys, "comfyui", "install", str(locked / "ComfyUI"))
    finally:
        locked.chmod(0o700)


# --------------------------------------------------------------------------- item 6: two spellings of one variable


@pytest.mark.parametrize("first, second", [("membackend_backend", "Membackend_Backend"),
                                           ("membackend_backend", "MEMBACKEND_BACKEND")])
def test_one_variable_in_two_spellings_with_different_values_is_refused_naming_both(monkeypatch, capsys, first,
                                                                                     second):
    monkeypatch.setenv(first, "vmm")
    monkeypatch.setenv(second, "host")
    for read in (load_settings, quick_settings):
        with pytest.raises(ConfigError) as info:
            read()
        text = one_line(info.value)
        assert info.value.key == "MEMBACKEND_BACKEND"
        assert f"{first}='vmm'" in text and f"{second}='host'" in text and "accepted: one spelling" in text
    line = exits_2(capsys, "backends")
    assert f"env {first}" in line and f"env {second}" in line


def test_the_same_value_in_two_spellings_is_one_value(monkeypatch):
    monkeypatch.setenv("membackend_backend", "host")
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    s = load_settings()
    assert s.backend == "host" and s.source_of("backend") == "env MEMBACKEND_BACKEND"


def test_the_comfyui_adapter_switches_itself_off_on_two_spellings(monkeypatch, caplog):
    pytest.importorskip("comfy_aimdo")
    from membackend._comfyui import startup

    monkeypatch.setenv("membackend_disable", "0")
    monkeypatch.setenv("MEMBACKEND_DISABLE", "1")
    caplog.set_level(logging.INFO, logger="membackend")
    assert startup.prestartup() is None  # never raises: ComfyUI starts stock
    said = [r.getMessage() for r in caplog.records if r.name == "membackend"]
    assert len(said) == 1 and "not started (ConfigError: MEMBACKEND_DISABLE" in said[0], said


# --------------------------------------------------------------------------- item 7: profile names


def test_a_profile_name_in_any_case_is_that_profile(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "Strix-Halo-128GB")
    assert load_settings().sim_profile == "strix-halo-128gb"
    code, out, _ = run(capsys, "backends")
    assert code == 0 and "selected: " in out


def test_an_unknown_profile_gets_the_closest_name_and_every_profile_from_the_table(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "strix-halo-128")
    with pytest.raises(ConfigError) as info:
        BackendManager(load_settings(), entry_points=[])
    err = info.value
    assert (err.key, err.source) == ("sim_profile", "env MEMBACKEND_SIM_PROFILE")
    assert "did you mean strix-halo-128gb?" in str(err) and err.accepted == ", ".join(PROFILES)
    assert len(PROFILES) == 11 and "did you mean strix-halo-128gb?" in exits_2(capsys, "doctor")
    with pytest.raises(ConfigError, match="did you mean h200\\?") as info:
        get_profile("h20")
    assert info.value.accepted == ", ".join(PROFILES)


def test_the_settings_accept_any_text_as_a_profile_and_list_none_of_their_own():
    from membackend._settings.rules import BY_NAME

    assert "wddm-6gb" not in BY_NAME["sim_profile"].accepted  # a list written there named 5 of the 10
    with pytest.raises(ConfigError, match="is not a profile name"):
        load_settings(sim_profile=5)


def test_a_replay_profile_in_any_case_or_misspelt(capsys):
    assert replay("churn-wddm", profile="WDDM-6GB", policy="stock", seeds=1).profile == "wddm-6gb"
    assert "did you mean h200?" in exits_2(capsys, "replay", "churn-wddm", "--profile", "h20")
    assert "profile '' is unknown" in exits_2(capsys, "replay", "churn-wddm", "--profile", "")


# --------------------------------------------------------------------------- item 8: what a refusal echoes


def test_a_huge_backend_or_profile_name_is_cut_short_with_its_length(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_BACKEND", HUGE)
    line = exits_2(capsys, "backends")
    assert len(line) < 1000 and "(100,000 characters in all)" in line
    monkeypatch.delenv("MEMBACKEND_BACKEND")
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", HUGE)
    line = exits_2(capsys, "backends")
    assert len(line) < 1000 and "(100,000 characters in all)" in line
    line = exits_2(capsys, "replay", "churn-wddm", "--profile", HUGE)
    assert len(line) < 1000 and "(100,000 characters in all)" in line


def test_an_empty_replay_source_is_named_as_empty(capsys):
    with pytest.raises(ReplayError, match="^'' names no built-in scenario and no file"):
        replay("")
    line = exits_2(capsys, "replay", "")
    assert line.startswith("membackend: '' names no built-in scenario") and "accepted: " in line


def test_a_path_with_a_newline_is_quoted(tmp_path, capsys):
    line = exits_2(capsys, "replay", str(tmp_path / "no\nsuch.jsonl"))
    assert "no\\nsuch.jsonl" in line and line.startswith("membackend: '")
    line = exits_2(capsys, "comfyui", "install", str(tmp_path / "Comfy\nUI"))
    assert "Comfy\\nUI" in line


def test_one_helper_shows_paths_and_names():
    assert shown("run.jsonl") == "run.jsonl" and shown("") == "''" and shown("a\nb") == "'a\\nb'"
    cut = shown("/x/" + "a" * 500 + "/run.jsonl")
    assert cut.endswith("/run.jsonl (513 characters in all)") and len(cut) < 260
    assert did_you_mean("CUDA_WDM", ["cuda_wddm", "vmm"]) == "; did you mean cuda_wddm?"
    assert did_you_mean(HUGE, ["cuda_wddm"]) == ""


# --------------------------------------------------------------------------- typos that gave the wrong advice


def test_replay_with_a_misspelt_backend_gets_the_closest_name_not_an_install_hint(capsys):
    line = exits_2(capsys, "replay", "churn-wddm", "--backend", "cuda_wdm")
    assert "did you mean cuda_wddm?" in line and "pip install" not in line
    with pytest.raises(PluginMissing) as info:  # a plugin the replays know, not installed: how to install it
        from membackend.lab._replay.engine import _check_installed

        _check_installed(BackendManager(load_settings(), builtins=[], entry_points=[]), "rocm_windows")
    assert "pip install membackend-rocm-windows" in str(info.value)


def test_a_backend_name_in_capitals_is_that_backend(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "h200")
    monkeypatch.setenv("MEMBACKEND_BACKEND", "VMM")
    assert BackendManager(load_settings()).select().record.name == "vmm"
    pytest.importorskip("membackend_cuda_wddm")
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "wddm-6gb")
    monkeypatch.setenv("MEMBACKEND_BACKEND", "CUDA_WDDM")
    code, out, _ = run(capsys, "backends")
    assert code == 0 and "selected: cuda_wddm (forced)" in out


@pytest.mark.parametrize("text, says", [
    ('backend = "vmn"\n', "backend 'vmn' is not installed; did you mean vmm? (installed: "),
    ('sim_profile = "h20"\n', "sim_profile (from membackend.toml): unknown simulation profile 'h20'; did you mean h200?"),
])
def test_a_typo_in_membackend_toml_names_the_file(tmp_path, capsys, text, says):
    (tmp_path / "membackend.toml").write_text(text)
    line = exits_2(capsys, "doctor")
    assert says in line, line
    assert "(from membackend.toml)" in line or line.endswith("; the name is from membackend.toml"), line


# --------------------------------------------------------------------------- settings errors that did not exit 2


DEPTH = Platform(name="deep", vendor="cuda", probe=lambda machine: None,
                 settings=(PlatformSetting("depth", parse=size, default=0, doc="how deep"),))


def test_a_bad_setting_of_a_platform_is_a_config_error_not_a_broken_plugin(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_DEEP_DEPTH", "lots")
    with pytest.raises(ConfigError) as info:
        BackendManager(load_settings(sim_profile="h200"),
                       entry_points=[EntryPoint("deep", "test_round6_inputs:DEPTH", GROUP)])
    assert one_line(info.value).startswith("deep.depth (from env MEMBACKEND_DEEP_DEPTH): 'lots' is not a size")


def test_a_bad_wddm_headroom_exits_2_instead_of_moving_off_the_plugin(monkeypatch, capsys):
    pytest.importorskip("membackend_cuda_wddm")
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "wddm-6gb")
    monkeypatch.setenv("MEMBACKEND_CUDA_WDDM_HEADROOM", "lots")
    for command in ("doctor", "backends"):
        assert exits_2(capsys, command).startswith(
            "membackend: configuration error: cuda_wddm.headroom (from env MEMBACKEND_CUDA_WDDM_HEADROOM): 'lots' "
            "is not a size")


def _ram(monkeypatch, total: int) -> None:
    """The host backend draws from ``total`` bytes of RAM, whatever this machine has."""
    mem = HostMemory(total, total, "psutil MemAvailable", total, total, None)
    monkeypatch.setattr(host_backend, "host_memory", lambda: mem)


def test_a_host_capacity_above_the_ram_is_refused_in_human_units(monkeypatch, capsys):
    _ram(monkeypatch, 24 * GiB)
    monkeypatch.setenv("MEMBACKEND_HOST_CAPACITY", "1TB")
    with pytest.raises(ConfigError) as info:
        BackendManager(load_settings(), entry_points=[])
    assert (info.value.key, info.value.source) == ("host_capacity", "env MEMBACKEND_HOST_CAPACITY")
    assert "'1TB' (931.3 GiB) is more than this machine's 24.0 GiB of RAM" in one_line(info.value)
    assert "'1TB' (931.3 GiB) is more than" in exits_2(capsys, "doctor")
    monkeypatch.setenv("MEMBACKEND_HOST_CAPACITY", "24GiB")  # all of it: a cap that caps nothing, but true
    assert BackendManager(load_settings(), entry_points=[]).settings.host_capacity == 24 * GiB
