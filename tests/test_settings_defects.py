"""Settings that used to escape ConfigError (issue 7, 4.12), and sizes parsed by pydantic's ByteSize."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from membackend._settings import SIZE_ACCEPTED, load_settings, parse_bytes
from membackend.types import ConfigError

MEMBACKEND = Path(sys.executable).with_name("membackend")


def doctor(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    return subprocess.run([str(MEMBACKEND), "doctor"], env={**clean, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- MEMBACKEND_TRACE


def test_a_trace_path_that_cannot_be_created_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MEMBACKEND_TRACE", str(tmp_path / "a-file" / "logs" / "trace.jsonl"))
    with pytest.raises(ConfigError) as info:
        load_settings()
    e = info.value
    assert (e.key, e.source) == ("trace", "env MEMBACKEND_TRACE")
    assert "cannot open" in str(e) and "for appending" in e.accepted


def test_a_failed_trace_check_removes_the_directories_it_created(tmp_path, monkeypatch):
    target = tmp_path / "new" / "deeper" / ("x" * 300)  # the directories can be made, the file name is too long
    monkeypatch.setenv("MEMBACKEND_TRACE", str(target))
    with pytest.raises(ConfigError, match="trace .from env MEMBACKEND_TRACE.: cannot open"):
        load_settings()
    assert not (tmp_path / "new").exists()


def test_a_directory_is_not_a_trace_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_settings(trace=tmp_path)
    assert (info.value.key, info.value.source) == ("trace", "kwargs")


def test_a_writable_trace_path_gets_its_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_TRACE", str(tmp_path / "logs" / "trace.jsonl"))
    s = load_settings()
    assert s.trace == tmp_path / "logs" / "trace.jsonl" and s.trace.parent.is_dir()


# --------------------------------------------------------------------------- MEMBACKEND_MACHINE


def test_a_machine_value_that_is_not_json_is_a_config_error(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE", "x")
    with pytest.raises(ConfigError) as info:
        load_settings()
    e = info.value
    assert (e.key, e.source) == ("machine", "env MEMBACKEND_MACHINE")
    assert "cannot be decoded" in str(e) and "JSON object" in e.accepted and "MEMBACKEND_MACHINE__OS" in e.accepted


def test_a_machine_json_object_still_works(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE", '{"os": "windows", "cpus": 4}')
    m = load_settings().machine
    assert (m.os, m.cpus) == ("windows", 4)


# --------------------------------------------------------------------------- config files


@pytest.mark.parametrize("name,source", [("membackend.toml", "membackend.toml"),
                                         ("pyproject.toml", "pyproject.toml")])
def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path, name, source):
    (tmp_path / name).write_bytes(b'backend = "h\xf6st"\n')  # Latin-1, as an old editor might save it
    with pytest.raises(ConfigError) as info:
        load_settings()
    e = info.value
    assert (e.key, e.source) == ("config", source)
    assert "not UTF-8" in str(e) and "UTF-8 TOML" in e.accepted


def test_broken_toml_in_pyproject_names_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.membackend\n")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.source == "pyproject.toml" and "not valid TOML" in str(info.value)


def test_a_config_path_that_does_not_exist_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError) as info:
        load_settings()
    e = info.value
    assert (e.key, e.source) == ("config", "env MEMBACKEND_CONFIG")
    assert "does not exist" in str(e) and "existing" in e.accepted


def test_a_config_path_that_is_a_directory_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path))
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings()


# --------------------------------------------------------------------------- the CLI


@pytest.mark.skipif(not MEMBACKEND.exists(), reason="the console script is not installed next to this python")
@pytest.mark.parametrize("case", ["trace", "machine", "non-utf8", "missing-config"])
def test_doctor_prints_the_config_error_and_exits_2(tmp_path, case):
    env: dict[str, str] = {}
    if case == "trace":
        (tmp_path / "a-file").write_text("")
        env["MEMBACKEND_TRACE"] = str(tmp_path / "a-file" / "trace.jsonl")
    elif case == "machine":
        env["MEMBACKEND_MACHINE"] = "x"
    elif case == "non-utf8":
        (tmp_path / "membackend.toml").write_bytes(b'backend = "h\xf6st"\n')
    else:
        env["MEMBACKEND_CONFIG"] = str(tmp_path / "missing.toml")
    result = doctor(env, tmp_path)
    expected = {"trace": "trace (from env MEMBACKEND_TRACE)", "machine": "machine (from env MEMBACKEND_MACHINE)",
                "non-utf8": "config (from membackend.toml)", "missing-config": "config (from env MEMBACKEND_CONFIG)"}
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected[case] in result.stderr and "accepted:" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- sizes (pydantic ByteSize)


def test_every_unit_named_in_size_accepted_parses_in_any_case():
    units = re.findall(r"\b([kmgtpe]i?b|[kmgtpe]|b)\b", SIZE_ACCEPTED.split("units", 1)[1])
    assert {"b", "k", "kb", "mb", "gib", "tib", "eib"} <= set(units)
    for unit in units:
        power = 1024 if "i" in unit else 1000
        exponent = "bkmgtpe".index(unit[0]) if unit != "b" else 0
        assert parse_bytes(f"3{unit}") == parse_bytes(f"3 {unit.upper()}") == 3 * power**exponent, unit


@pytest.mark.parametrize("bad", [True, False, "1Mi", "-1", "1e3", 1.5, None, b"1MiB"])
def test_sizes_that_are_refused(bad):
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(bad)


def test_a_bad_size_setting_lists_the_units(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_HOST_CAPACITY", "2 gigs")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.key == "host_capacity" and "mib" in info.value.accepted and "powers of 1024" in info.value.accepted
