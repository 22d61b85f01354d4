"""Settings precedence (kwargs > env > membackend.toml > pyproject > defaults) and error messages."""

from __future__ import annotations

import pytest

from membackend._settings import load_settings, parse_bytes
from membackend.types import ConfigError

GiB = 1 << 30


def write(path, text):
    path.write_text(text)
    return path


def test_defaults():
    s = load_settings()
    assert (s.backend, s.disable, s.block, s.headroom, s.sanitize, s.trace) == (None, False, [], None, False, None)


def test_precedence_each_layer_overrides_the_one_below(tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", '[tool.membackend]\nbackend = "frompyproject"\nheadroom = "1GiB"\n'
                                       'sanitize = true\npage_size = "4MiB"\n')
    s = load_settings()
    assert (s.backend, s.headroom, s.sanitize, s.page_size) == ("frompyproject", GiB, True, 4 << 20)

    write(tmp_path / "membackend.toml", 'backend = "fromtoml"\nheadroom = "2GiB"\n')
    s = load_settings()
    assert (s.backend, s.headroom, s.sanitize) == ("fromtoml", 2 * GiB, True)

    monkeypatch.setenv("MEMBACKEND_BACKEND", "fromenv")
    s = load_settings()
    assert (s.backend, s.headroom) == ("fromenv", 2 * GiB)

    s = load_settings(backend="fromkwargs")
    assert (s.backend, s.headroom, s.page_size) == ("fromkwargs", 2 * GiB, 4 << 20)


def test_config_path_from_env(tmp_path, monkeypatch):
    cfg = write(tmp_path / "elsewhere.toml", 'disable = true\nblock = ["gamma"]\n')
    write(tmp_path / "membackend.toml", "disable = false\n")
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(cfg))
    s = load_settings()
    assert s.disable and s.block == ["gamma"]


def test_machine_overrides_from_env(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_MACHINE__OS", "Windows")
    monkeypatch.setenv("MEMBACKEND_MACHINE__RAM_TOTAL", "64GiB")
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", '[{"kind": "hip", "index": 1, "total_memory": "16GiB"}]')
    m = load_settings().machine
    assert m.os == "windows" and m.ram_total == 64 * GiB
    assert m.devices[0].kind == "hip" and m.devices[0].total_memory == 16 * GiB


@pytest.mark.parametrize("text,expected", [
    (0, 0), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("2 GiB", 2 * GiB), ("4096", 4096), ("1k", 1000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1", "12XB", "", True, [1], -5])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


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


def test_broken_toml_is_a_config_error(tmp_path):
    write(tmp_path / "membackend.toml", "backend = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings()
