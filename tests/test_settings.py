"""The settings package's model, sources and rules: precedence (kwargs > env > membackend.toml > pyproject >
defaults) and the source of every value, the one parser per field, the errors (key, source, what is
accepted), the settings a platform declares, and how the doctor shows them. The quick start-up path has its
own file, ``test_settings_quick.py``."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from membackend._backends.host import HostBackend
from membackend._backends.vmm import VmmBackend
from membackend._cli import _print_settings, settings_report
from membackend._manager import BackendManager
from membackend._settings import (
    DEFAULTS,
    FIELDS,
    SIZE_ACCEPTED,
    SIZE_MAX,
    UNITS,
    Settings,
    format_bytes,
    load_settings,
    parse_bytes,
    rules,
)
from membackend._settings.rules import RuleError
from membackend.platform import Platform, PlatformSetting, flag, size
from membackend.types import Candidate, Capabilities, ConfigError, Device

GiB, MiB = 1 << 30, 1 << 20
MEMBACKEND = Path(sys.executable).with_name("membackend")


def write(path, text):
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- defaults, precedence, sources


def test_defaults_and_their_source():
    s = load_settings()
    assert (s.backend, s.disable, s.block, s.headroom, s.sanitize, s.trace) == (None, False, [], None, False, None)
    assert s.page_size == 2 * MiB and s.probe_timeout == 10.0
    assert all(s.source_of(name) == "default" for name in FIELDS) and s.model_fields_set == set()


def test_precedence_each_layer_overrides_the_one_below_and_names_itself(tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", '[tool.membackend]\nbackend = "frompyproject"\nheadroom = "1GiB"\n'
                                       'sanitize = true\npage_size = "4MiB"\n')
    s = load_settings()
    assert (s.backend, s.headroom, s.sanitize, s.page_size) == ("frompyproject", GiB, True, 4 << 20)
    assert s.source_of("backend") == "pyproject.toml [tool.membackend]"

    write(tmp_path / "membackend.toml", 'backend = "fromtoml"\nheadroom = "2GiB"\n')
    s = load_settings()
    assert (s.backend, s.headroom, s.sanitize) == ("fromtoml", 2 * GiB, True)
    assert (s.source_of("backend"), s.source_of("sanitize")) == ("membackend.toml", "pyproject.toml [tool.membackend]")

    monkeypatch.setenv("MEMBACKEND_BACKEND", "fromenv")
    s = load_settings()
    assert (s.backend, s.headroom) == ("fromenv", 2 * GiB) and s.source_of("backend") == "env MEMBACKEND_BACKEND"

    s = load_settings(backend="fromkwargs")
    assert (s.backend, s.headroom, s.page_size) == ("fromkwargs", 2 * GiB, 4 << 20)
    assert s.source_of("backend") == "kwargs" and s.model_fields_set == {"backend", "headroom", "sanitize",
                                                                          "page_size"}


def test_config_path_from_env(tmp_path, monkeypatch):
    cfg = write(tmp_path / "elsewhere.toml", 'disable = true\nblock = ["gamma"]\n')
    write(tmp_path / "membackend.toml", "disable = false\n")
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(cfg))
    s = load_settings()
    assert s.disable and s.block == ["gamma"] and s.source_of("block") == str(cfg)


def test_an_empty_variable_counts_as_not_set(tmp_path, monkeypatch):
    write(tmp_path / "membackend.toml", 'backend = "fromtoml"\n')
    monkeypatch.setenv("MEMBACKEND_BACKEND", "  ")
    monkeypatch.setenv("MEMBACKEND_TRACE", "")
    s = load_settings()
    assert (s.backend, s.trace) == ("fromtoml", None) and s.source_of("backend") == "membackend.toml"


def test_variable_names_match_in_any_case_and_other_membackend_variables_are_left_alone(monkeypatch):
    monkeypatch.setenv("membackend_backend", "host")
    monkeypatch.setenv("MEMBACKEND_WDDM_HEADROOM", "not read by membackend itself")
    s = load_settings()
    assert s.backend == "host" and s.source_of("backend") == "env membackend_backend"


def test_machine_overrides_from_env(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE__OS", "Windows")
    monkeypatch.setenv("MEMBACKEND_MACHINE__RAM_TOTAL", "64GiB")
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", '[{"kind": "hip", "index": 1, "total_memory": "16GiB"}]')
    m = load_settings().machine
    assert m.os == "windows" and m.ram_total == 64 * GiB
    assert m.devices[0].kind == "hip" and m.devices[0].total_memory == 16 * GiB and m.devices[0].vmm_supported


def test_machine_facts_merge_across_sources_each_naming_its_own(tmp_path, monkeypatch):
    write(tmp_path / "membackend.toml", '[machine]\nos = "linux"\ncpus = 3\n')
    monkeypatch.setenv("MEMBACKEND_MACHINE__CPUS", "12")
    monkeypatch.setenv("MEMBACKEND_MACHINE", '{"os": "darwin", "torch_vendor": "cpu"}')
    s = load_settings()
    assert (s.machine.os, s.machine.cpus, s.machine.torch_vendor) == ("darwin", 12, "cpu")
    assert s.source_of("machine.cpus") == "env MEMBACKEND_MACHINE__CPUS"  # one fact's variable over the JSON
    assert s.source_of("machine.os") == "env MEMBACKEND_MACHINE" and s.source_of("machine.ram_total") == "default"
    assert s.machine.model_fields_set == {"os", "cpus", "torch_vendor"}


# --------------------------------------------------------------------------- page_size: what it carries


def test_page_size_is_2_mib_unless_set_and_the_host_backend_takes_it():
    s = load_settings()
    assert s.page_size == rules.HOST_PAGE_SIZE == 2 * MiB and s.source_of("page_size") == "default"
    assert HostBackend.from_settings(s).page_size == 2 * MiB
    assert HostBackend.from_settings(load_settings(page_size="4MiB")).page_size == 4 * MiB
    assert "2 MiB" in Settings.model_fields["page_size"].description


# --------------------------------------------------------------------------- sizes: one parser, exact


@pytest.mark.parametrize("text,expected", [
    (0, 0), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("2 GiB", 2 * GiB), ("4096", 4096), ("1k", 1000),
    (" 8 mib ", 8 << 20), (".5KiB", 512), ("0100", 100), (2.0, 2), ("1.0000000001GiB", GiB + 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1", "12XB", "", True, False, [1], -5, "1Mi", "1e3", 1.5, None, b"1MiB",
                                 "1_000", "1 GiB extra", "5.", float("inf"), "٣"])
def test_sizes_that_are_refused_say_why(bad):
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(bad)


def test_a_size_with_more_digits_than_python_converts_is_refused_not_crashed():
    with pytest.raises(ValueError, match="too many digits"):
        parse_bytes("9" * 5000)


def test_every_unit_named_in_size_accepted_parses_in_any_case():
    units = re.findall(r"\b([kmgtpe]i?b|[kmgtpe]|b)\b", SIZE_ACCEPTED.split("units", 1)[1])
    assert set(units) == set(UNITS)
    for unit in units:
        power = 1024 if "i" in unit else 1000
        exponent = "bkmgtpe".index(unit[0]) if unit != "b" else 0
        assert parse_bytes(f"3{unit}") == parse_bytes(f"3 {unit.upper()}") == 3 * power**exponent, unit


@given(n=st.integers(min_value=0, max_value=1 << 80), unit=st.sampled_from(sorted(UNITS)),
       case=st.sampled_from([str.lower, str.upper, str.title]))
def test_parse_bytes_reads_back_what_format_bytes_writes_in_every_unit(n, unit, case):
    text = format_bytes(n, case(unit))
    if n > SIZE_MAX:  # written, but no setting takes it
        with pytest.raises(RuleError, match="larger than 8EiB"):
            parse_bytes(text)
        return
    assert parse_bytes(text) == n, text
    assert parse_bytes(format_bytes(n)) == n


@given(k=st.integers(min_value=0, max_value=10**6), unit=st.sampled_from(sorted(UNITS)), space=st.booleans())
def test_a_whole_number_of_units_is_that_many_times_the_unit(k, unit, space):
    text = f"{k}{' ' if space else ''}{unit}"
    if k * UNITS[unit] > SIZE_MAX:
        with pytest.raises(RuleError, match="larger than 8EiB"):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == k * UNITS[unit]


@pytest.mark.parametrize("value", ["9" * 5000, 10**5000, "1" + "0" * 41 + "b", 1e300, float(1 << 64), (1 << 63) + 1,
                                   "8.000001EiB", "0." + "1" * 5000, "x" * 10_000_000],
                         ids=["5000 nines", "10**5000", "42 digits", "1e300", "2**64 float", "2**63+1", "8.000001EiB",
                              "5000 decimals", "10 MB of x"])
def test_sizes_have_an_upper_bound_and_a_short_message(value):
    with pytest.raises(RuleError) as info:
        parse_bytes(value)
    assert "is not a size" in str(info.value) and len(str(info.value)) < 400, str(info.value)[:500]


def test_minus_zero_is_zero_and_8eib_is_the_largest_size():
    assert [parse_bytes(v) for v in ("-0", "-0.0", " -0 GiB ", "8EiB", SIZE_MAX)] == [0, 0, 0, SIZE_MAX, SIZE_MAX]
    for value in ("-1", "-0.5", "-1KiB"):
        with pytest.raises(RuleError, match="negative"):
            parse_bytes(value)


def test_format_bytes_picks_the_largest_binary_unit_that_divides():
    assert (format_bytes(512 << 20), format_bytes(1536, "KiB"), format_bytes(1000), format_bytes(0)) == \
        ("512MiB", "1.5KiB", "1000", "0")


# --------------------------------------------------------------------------- errors: key, source, accepted


def test_bad_env_value_names_key_source_and_accepted(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "lots")
    with pytest.raises(ConfigError) as info:
        load_settings()
    e = info.value
    assert (e.key, e.source) == ("headroom", "env MEMBACKEND_HEADROOM")
    assert "'lots' is not a size" in str(e) and "accepted: a byte count" in str(e)


def test_bad_boolean_from_toml(tmp_path):
    write(tmp_path / "membackend.toml", 'sanitize = "sometimes"\n')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.key == "sanitize" and info.value.source == "membackend.toml"
    assert "accepted: true/false" in str(info.value)


def test_bad_backend_name_from_pyproject(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.membackend]\nbackend = "Not A Name"\n')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.source == "pyproject.toml [tool.membackend]" and info.value.key == "backend"
    assert "installed backend" in info.value.accepted


def test_bad_kwarg():
    with pytest.raises(ConfigError) as info:
        load_settings(page_size=3000)
    assert info.value.source == "kwargs" and "power of two" in str(info.value)


def test_none_is_refused_where_a_setting_has_no_unset_meaning():
    with pytest.raises(ConfigError, match="disable .from kwargs.: None is not accepted here"):
        load_settings(disable=None)
    assert load_settings(backend=None).backend is None  # None: not set (a kwarg still wins over the env)


def test_unknown_key_lists_the_known_ones(tmp_path):
    write(tmp_path / "membackend.toml", 'backnd = "host"\n')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.key == "backnd" and "unknown key" in str(info.value)
    assert "backend" in info.value.accepted and "headroom" in info.value.accepted


def test_bad_nested_machine_value(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", '[{"kind": "tpu"}]')
    with pytest.raises(ConfigError) as info:
        load_settings()
    e = info.value
    assert e.key == "machine.devices.0.kind" and e.source == "env MEMBACKEND_MACHINE__DEVICES"
    assert "cpu, cuda, hip" in e.accepted


def test_unknown_nested_key(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", '[{"kind": "cuda", "vram": 1}]')
    with pytest.raises(ConfigError, match="machine.devices.0.vram .*unknown key.*total_memory"):
        load_settings()


def test_an_unknown_machine_variable_is_refused(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE__GPUS", "2")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert (info.value.key, info.value.source) == ("machine.gpus", "env MEMBACKEND_MACHINE__GPUS")
    assert "devices" in info.value.accepted


def test_broken_toml_is_a_config_error(tmp_path):
    write(tmp_path / "membackend.toml", "backend = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings()


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


def _doctor(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    return subprocess.run([str(MEMBACKEND), "doctor"], env={**clean, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


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
    result = _doctor(env, tmp_path)
    expected = {"trace": "trace (from env MEMBACKEND_TRACE)", "machine": "machine (from env MEMBACKEND_MACHINE)",
                "non-utf8": "config (from membackend.toml)", "missing-config": "config (from env MEMBACKEND_CONFIG)"}
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected[case] in result.stderr and "accepted:" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_size_setting_lists_the_units(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_HOST_CAPACITY", "2 gigs")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.key == "host_capacity"
    assert "mib" in info.value.accepted and "powers of 1024" in info.value.accepted


# --------------------------------------------------------------------------- the model, built from the table


def test_the_model_has_one_field_per_entry_of_the_table_with_its_default_and_what_it_accepts():
    fields = Settings.model_fields
    assert tuple(fields) == FIELDS == tuple(f.name for f in rules.FIELDS)
    for f in rules.FIELDS:
        assert fields[f.name].json_schema_extra["accepted"] == f.accepted and f.accepted, f.name
        if f.name in DEFAULTS:
            assert fields[f.name].default == DEFAULTS[f.name] == f.default, f.name
    assert fields["block"].default_factory() == []


def test_the_model_built_directly_puts_values_through_the_same_rules():
    assert Settings(headroom="1GiB", block="aimdo, vmm").headroom == GiB
    assert Settings(block="aimdo, vmm").block == ["aimdo", "vmm"]
    with pytest.raises(ValueError, match="'lots' is not a size"):
        Settings(headroom="lots")
    with pytest.raises(ValueError, match="extra"):
        Settings(hedroom=1)


def test_settings_pickle_with_their_sources():
    s = load_settings(headroom="1GiB")
    again = pickle.loads(pickle.dumps(s))
    assert again == s and again.source_of("headroom") == "kwargs"


def test_importing_the_package_imports_no_pydantic():
    code = "import sys, membackend._settings; print(sorted(m for m in sys.modules if m.startswith('pydantic')))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr


# --------------------------------------------------------------------------- settings a platform declares

GROUP = "membackend.backends"


def _depth(raw):
    if isinstance(raw, str) and raw.isdigit():
        raw = int(raw)
    if not isinstance(raw, int) or isinstance(raw, bool) or not 1 <= raw <= 8:
        raise ValueError(f"{raw!r} is not a depth from 1 to 8")
    return raw


def _probe(machine, settings):
    return Candidate("declared", 0, f"opt-in platform; depth {settings['depth']} from {settings.source('depth')}",
                     opt_in=True)


def _capabilities(settings):
    return Capabilities(recycle_handles=settings["recycle"], recycle_limit=settings["depth"])


def _headroom(total, settings):
    return settings["room"] or total // 10


DECLARED = Platform(
    name="declared", vendor="cuda", probe=_probe, capabilities=_capabilities, headroom=_headroom,
    settings=(PlatformSetting("depth", parse=_depth, default=2, accepted="a whole number from 1 to 8",
                              doc="how deep"),
              PlatformSetting("recycle", parse=flag, default=False, doc="recycle handles"),
              PlatformSetting("room", parse=size.or_none(), default=None, doc="headroom; default a tenth")))


def test_a_platform_setting_is_read_under_the_platform_s_name_from_every_source_in_order(tmp_path, monkeypatch):
    values = DECLARED.setting_values()
    assert dict(values) == {"depth": 2, "recycle": False, "room": None} and values.source("depth") == "default"
    write(tmp_path / "pyproject.toml", "[tool.membackend.declared]\ndepth = 3\nrecycle = true\n")
    values = DECLARED.setting_values()
    assert (values["depth"], values.source("depth")) == (3, "pyproject.toml [tool.membackend.declared]")
    write(tmp_path / "membackend.toml", "[declared]\ndepth = 4\n")
    values = DECLARED.setting_values()
    assert (values["depth"], values.source("depth"), values["recycle"]) == (4, "membackend.toml [declared]", True)
    monkeypatch.setenv("MEMBACKEND_DECLARED_DEPTH", "5")
    values = DECLARED.setting_values()
    assert (values["depth"], values.source("depth")) == (5, "env MEMBACKEND_DECLARED_DEPTH")
    assert values.env_name("room") == DECLARED.env_name("room") == "MEMBACKEND_DECLARED_ROOM"
    settings = load_settings(declared={"depth": 6})
    values = DECLARED.setting_values(settings)
    assert (values["depth"], values.source("depth")) == (6, "kwargs")
    monkeypatch.setenv("MEMBACKEND_DECLARED_DEPTH", "7")  # read once: the settings' reading, not the env now
    assert DECLARED.setting_values(settings)["depth"] == 6


@pytest.mark.parametrize("where, raw, source", [
    ("env", "9", "env MEMBACKEND_DECLARED_DEPTH"), ("toml", '"deep"', "membackend.toml [declared]"),
    ("kwargs", True, "kwargs")])
def test_a_bad_platform_setting_names_the_platform_s_key_its_source_and_what_is_accepted(
        tmp_path, monkeypatch, where, raw, source):
    kwargs = {}
    if where == "env":
        monkeypatch.setenv("MEMBACKEND_DECLARED_DEPTH", raw)
    elif where == "toml":
        write(tmp_path / "membackend.toml", f"[declared]\ndepth = {raw}\n")
    else:
        kwargs = {"declared": {"depth": raw}}
    with pytest.raises(ConfigError) as info:
        DECLARED.setting_values(load_settings(**kwargs))
    e = info.value
    assert (e.key, e.source, e.accepted) == ("declared.depth", source, "a whole number from 1 to 8")
    assert "is not a depth from 1 to 8" in str(e)


def test_a_rule_s_error_and_its_accepted_text_reach_a_platform_setting(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_DECLARED_ROOM", "lots")
    with pytest.raises(ConfigError) as info:
        DECLARED.setting_values()
    assert info.value.key == "declared.room" and "'lots' is not a size" in str(info.value)
    assert info.value.accepted == SIZE_ACCEPTED


def test_a_key_a_platform_does_not_declare_is_refused_and_a_table_is_no_unknown_key(tmp_path):
    write(tmp_path / "membackend.toml", "[declared]\ndpeth = 3\n")
    assert load_settings().backend is None  # a table: a platform's, checked when the platform loads
    with pytest.raises(ConfigError) as info:
        DECLARED.setting_values()
    assert (info.value.key, info.value.source) == ("declared.dpeth", "membackend.toml [declared]")
    assert info.value.accepted == "one of: depth, recycle, room"
    write(tmp_path / "membackend.toml", "declared = 3\n")  # not a table: no platform's, an unknown key
    with pytest.raises(ConfigError, match="declared .from membackend.toml.: unknown key"):
        load_settings()


@pytest.mark.parametrize("bad, match", [
    ({"name": "host", "settings": (PlatformSetting("capacity", parse=size),)}, "MEMBACKEND_HOST_CAPACITY"),
    ({"name": "trace", "settings": (PlatformSetting("depth", parse=size),)}, "named like one of membackend's"),
    ({"settings": (PlatformSetting("a", parse=size), PlatformSetting("a", parse=flag))}, "declared twice"),
    ({"settings": ("headroom",)}, "PlatformSetting records"),
])
def test_a_platform_refuses_settings_membackend_could_not_read_unambiguously(bad, match):
    with pytest.raises(ValueError, match=match):
        Platform(**{"name": "p", "probe": _probe, **bad})


@pytest.mark.parametrize("bad, match", [({"name": "Depth"}, "lower-case"), ({"parse": 3}, "callable"),
                                        ({"parse": _depth}, "say what parse accepts")])
def test_a_platform_setting_refuses_what_it_could_not_report(bad, match):
    with pytest.raises(ValueError, match=match):
        PlatformSetting(**{"name": "depth", "parse": size, **bad})


def test_the_values_reach_the_platform_s_functions_through_the_backend(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_DECLARED_RECYCLE", "yes")
    settings = load_settings(sim_profile="h200", declared={"depth": "3", "room": "1GiB"})
    backend = VmmBackend.from_settings(settings, DECLARED)
    assert dict(backend.platform_values) == {"depth": 3, "recycle": True, "room": GiB}
    assert backend.capabilities.recycle_handles and backend.capabilities.recycle_limit == 3
    assert DECLARED.capabilities.recycle_limit == 2  # the record itself: its defaults
    assert "depth 3 from kwargs" in backend.membackend_probe(machine=None).reason
    assert backend.own_headroom(Device("cuda", 0), 10 * GiB) == (GiB, "platform declared's own rule")
    assert DECLARED.headroom_for(10 * GiB) == GiB  # the defaults: a tenth of 10 GiB
    assert DECLARED.headroom_for(20 * GiB, backend.platform_values) == GiB  # the setting's 1 GiB


def test_a_bad_platform_setting_is_a_config_error_not_a_broken_plugin(monkeypatch):
    """A settings error like any other (issue 42, round 6): listing the plugin as broken selected another
    backend, and the typo went unseen."""
    monkeypatch.setenv("MEMBACKEND_DECLARED_DEPTH", "99")
    with pytest.raises(ConfigError) as info:
        BackendManager(load_settings(sim_profile="h200"),
                       entry_points=[EntryPoint("declared", "test_settings:DECLARED", GROUP)])
    assert str(info.value).startswith("declared.depth (from env MEMBACKEND_DECLARED_DEPTH): 99 is not a depth")


def test_the_doctor_shows_every_value_with_its_source_and_what_nothing_reads(tmp_path, monkeypatch, capsys):
    write(tmp_path / "membackend.toml", '[declared]\nrecycle = true\n[ghost]\nanything = 1\n')
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "1GiB")
    monkeypatch.setenv("MEMBACKEND_DECLARED_DEPTH", "3")
    monkeypatch.setenv("MEMBACKEND_DECLARED_DPETH", "4")
    monkeypatch.setenv("MEMBACKEND_NOTHING", "1")
    monkeypatch.setenv("MEMBACKEND_MACHINE__CPUS", "4")
    mgr = BackendManager(load_settings(sim_profile="h200"),
                         entry_points=[EntryPoint("declared", "test_settings:DECLARED", GROUP)])
    report = settings_report(mgr)
    rows = {r["key"]: r for r in report["values"]}
    assert (rows["headroom"]["value"], rows["headroom"]["source"]) == (GiB, "env MEMBACKEND_HEADROOM")
    assert (rows["declared.depth"]["value"], rows["declared.depth"]["source"]) == (3, "env MEMBACKEND_DECLARED_DEPTH")
    assert rows["declared.recycle"]["source"] == "membackend.toml [declared]"
    assert rows["machine.cpus"]["source"] == "env MEMBACKEND_MACHINE__CPUS" and "machine.os" not in rows
    assert {r["env"] for r in report["unread"]} == {"MEMBACKEND_DECLARED_DPETH", "MEMBACKEND_NOTHING"}
    assert report["tables_without_platform"] == ["ghost"]
    _print_settings(report)
    out = capsys.readouterr().out
    assert "  headroom: 1GiB  [env MEMBACKEND_HEADROOM]" in out
    assert "  page_size: 2MiB  [default]" in out and "  backend: -  [default]" in out
    assert "  declared.depth: 3  [env MEMBACKEND_DECLARED_DEPTH]" in out
    assert "  declared.room: -  [default]" in out
    assert ("MEMBACKEND_DECLARED_DPETH is set but not read: platform declared declares no such setting "
            "(it declares: depth, recycle, room)") in out
    assert "MEMBACKEND_NOTHING is set but not read: no setting of membackend or of an installed platform" in out
    assert "the settings table [ghost] names no installed platform" in out


class OwnSettings(HostBackend):
    """A backend that is no platform record, declaring settings of its own (as docs/backends.md shows)."""

    name = "ownsettings"
    settings = (PlatformSetting("pool", parse=size, default=None, doc="bytes the backend may hold"),
                PlatformSetting("verbose", parse=flag, default=False, doc="log every verb"))

    @classmethod
    def from_settings(cls, settings, values=None):
        backend = super().from_settings(settings)
        backend.values = values
        return backend


def test_a_backend_that_is_no_platform_declares_settings_read_as_a_platform_s(tmp_path, monkeypatch, capsys):
    write(tmp_path / "membackend.toml", "[ownsettings]\nverbose = true\n")
    monkeypatch.setenv("MEMBACKEND_OWNSETTINGS_POOL", "2GiB")
    monkeypatch.setenv("MEMBACKEND_OWNSETTINGS_POLL", "1")
    mgr = BackendManager(load_settings(), entry_points=[EntryPoint("own", "test_settings:OwnSettings", GROUP)])
    record = mgr.records["ownsettings"]
    assert dict(record.plugin.values) == {"pool": 2 * GiB, "verbose": True}
    assert record.values.source("pool") == "env MEMBACKEND_OWNSETTINGS_POOL"
    report = settings_report(mgr)
    rows = {r["key"]: r for r in report["values"]}
    assert rows["ownsettings.verbose"]["source"] == "membackend.toml [ownsettings]"
    assert [r["env"] for r in report["unread"]] == ["MEMBACKEND_OWNSETTINGS_POLL"]
    assert "declares no such setting (it declares: pool, verbose)" in report["unread"][0]["why"]
    assert "ownsettings" not in report["tables_without_platform"]


def test_a_bad_value_of_a_backend_s_own_setting_is_a_config_error_naming_the_key(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_OWNSETTINGS_POOL", "lots")
    with pytest.raises(ConfigError, match=r"^ownsettings\.pool \(from env MEMBACKEND_OWNSETTINGS_POOL\): 'lots'"):
        BackendManager(load_settings(), entry_points=[EntryPoint("own", "test_settings:OwnSettings", GROUP)])


class ClashingSettings(OwnSettings):
    """Named so that its setting would be read from membackend's own MEMBACKEND_HOST_CAPACITY."""

    name = "host"
    settings = (PlatformSetting("capacity", parse=size, default=None),)


def test_a_backend_s_setting_is_never_read_from_one_of_membackend_s_own_variables():
    mgr = BackendManager(load_settings(), entry_points=[EntryPoint("clash", "test_settings:ClashingSettings", GROUP)])
    assert "MEMBACKEND_HOST_CAPACITY, which membackend's own settings use" in mgr.broken["clash"], mgr.broken


def test_docs_settings_md_names_every_setting_its_variable_and_every_machine_fact():
    text = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    for f in rules.FIELDS:
        assert f"`{f.name}" in text and f"MEMBACKEND_{f.name.upper()}" in text, f.name
    for fact in (*rules.MACHINE_FIELDS, *rules.DEVICE_FIELDS):
        assert f"`{fact.name}`" in text, fact.name
