"""quick_settings (the start-up path without pydantic) against load_settings.

Both read the same sources and resolve them with the same code, so for every input -- valid or not, in any
spelling -- they give the same values with the same sources, or raise the same ConfigError: a table of
cases, then the same claim for generated environments and files. Only machine overrides make the quick path
build the pydantic model; everything else is served without importing pydantic."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from membackend import _settings as S
from membackend._settings import QuickSettings, load_settings, quick_settings
from membackend.types import ConfigError

QUICK, MODEL, ERROR = "quick", "model", "error"

#: (id, environment, membackend.toml, pyproject.toml, what quick_settings returns)
CASES = [
    ("defaults", {}, None, None, QUICK),
    ("backend", {"MEMBACKEND_BACKEND": "host"}, None, None, QUICK),
    ("backend-dash", {"MEMBACKEND_BACKEND": "cuda-wddm_2"}, None, None, QUICK),
    ("disable-1", {"MEMBACKEND_DISABLE": "1"}, None, None, QUICK),
    ("disable-no", {"MEMBACKEND_DISABLE": "no"}, None, None, QUICK),
    ("on", {"MEMBACKEND_DISABLE": "on"}, None, None, QUICK),
    ("TRUE", {"MEMBACKEND_SANITIZE": "TRUE"}, None, None, QUICK),
    ("flags", {"MEMBACKEND_DISABLE": "false", "MEMBACKEND_SANITIZE": "yes"}, None, None, QUICK),
    ("block", {"MEMBACKEND_BLOCK": " aimdo , vmm,, "}, None, None, QUICK),
    ("block-empty", {"MEMBACKEND_BLOCK": ""}, None, None, QUICK),
    ("sizes", {"MEMBACKEND_HEADROOM": "0", "MEMBACKEND_HOST_CAPACITY": "268435456"}, None, None, QUICK),
    ("units", {"MEMBACKEND_HEADROOM": "512MiB"}, None, None, QUICK),
    ("leading-zero", {"MEMBACKEND_HEADROOM": "0100"}, None, None, QUICK),
    ("page", {"MEMBACKEND_PAGE_SIZE": "2097152"}, None, None, QUICK),
    ("timeout", {"MEMBACKEND_PROBE_TIMEOUT": "2.5"}, None, None, QUICK),
    ("timeout-exp", {"MEMBACKEND_PROBE_TIMEOUT": "1e1"}, None, None, QUICK),
    ("timeout-max", {"MEMBACKEND_PROBE_TIMEOUT": "600"}, None, None, QUICK),
    ("profile", {"MEMBACKEND_SIM_PROFILE": "h200"}, None, None, QUICK),
    ("trace", {"MEMBACKEND_TRACE": "logs/run.jsonl"}, None, None, QUICK),
    ("other-vars", {"MEMBACKEND_WDDM_HEADROOM": "x", "MEMBACKEND_FOO": "1"}, None, None, QUICK),
    ("lower-case-var", {"membackend_backend": "host"}, None, None, QUICK),
    # names in any case, blanks around them ignored: backend names are lower-case, so CUDA_WDDM is cuda_wddm
    ("name-any-case", {"MEMBACKEND_BACKEND": "CUDA_WDDM", "MEMBACKEND_BLOCK": "Aimdo"}, None, None, QUICK),
    ("name-newline", {"MEMBACKEND_BACKEND": "host\n"}, None, None, QUICK),
    ("profile-any-case", {"MEMBACKEND_SIM_PROFILE": "Strix-Halo-128GB"}, None, None, QUICK),
    ("empty-name", {"MEMBACKEND_BACKEND": ""}, None, None, QUICK),  # empty: not set
    ("trace-empty", {"MEMBACKEND_TRACE": " "}, None, None, QUICK),
    ("toml", {}, 'backend = "vmm"\ndisable = true\nblock = ["aimdo"]\nheadroom = 1048576\nprobe_timeout = 3\n'
                 'page_size = "4194304"\ntrace = "t.jsonl"\n', None, QUICK),
    ("toml-block-text", {}, 'block = "aimdo,vmm"\nsanitize = "1"\n', None, QUICK),
    ("toml-int-as-flag", {}, "disable = 1\n", None, QUICK),
    ("toml-page-units", {}, 'page_size = "4MiB"\n', None, QUICK),
    ("toml-platform-table", {}, '[cuda_wddm]\nheadroom = "1GiB"\n', None, QUICK),
    ("pyproject", {}, None, '[project]\nname = "x"\n[tool.membackend]\nbackend = "frompyproject"\n', QUICK),
    ("comfyui-pyproject", {}, None, '[project]\nname = "comfyui"\n[tool.ruff]\nline-length = 120\n', QUICK),
    ("precedence", {"MEMBACKEND_BACKEND": "fromenv"}, 'backend = "fromtoml"\nheadroom = 7\n',
     '[tool.membackend]\nbackend = "frompyproject"\nheadroom = 9\nsanitize = true\n', QUICK),
    ("config-elsewhere", {"MEMBACKEND_CONFIG": "elsewhere.toml"}, None, None, QUICK),
    # machine overrides: the quick path hands back the model of the same reading
    ("machine", {"MEMBACKEND_MACHINE__OS": "Windows"}, None, None, MODEL),
    ("machine-json", {"MEMBACKEND_MACHINE": '{"cpus": 4}'}, None, None, MODEL),
    ("machine-toml", {}, "[machine]\nos = \"linux\"\n", None, MODEL),
    # invalid: the same ConfigError from both
    ("bad-name", {"MEMBACKEND_BACKEND": "Not A Name"}, None, None, ERROR),
    ("name-inner-newline", {"MEMBACKEND_BACKEND": "ho\nst"}, None, None, ERROR),
    ("bad-flag", {"MEMBACKEND_DISABLE": "2"}, None, None, ERROR),
    ("block-host", {"MEMBACKEND_BLOCK": "aimdo,host"}, None, None, ERROR),
    ("block-bad", {"MEMBACKEND_BLOCK": "aim do"}, None, None, ERROR),
    ("name-too-long", {"MEMBACKEND_BACKEND": "a" * 101}, None, None, ERROR),
    ("size-words", {"MEMBACKEND_HEADROOM": "lots"}, None, None, ERROR),
    ("size-negative", {"MEMBACKEND_HOST_CAPACITY": "-1"}, None, None, ERROR),
    ("underscore", {"MEMBACKEND_HOST_CAPACITY": "1_000"}, None, None, ERROR),
    ("page-odd", {"MEMBACKEND_PAGE_SIZE": "3000"}, None, None, ERROR),
    ("page-small", {"MEMBACKEND_PAGE_SIZE": "1024"}, None, None, ERROR),
    ("timeout-zero", {"MEMBACKEND_PROBE_TIMEOUT": "0"}, None, None, ERROR),
    ("timeout-big", {"MEMBACKEND_PROBE_TIMEOUT": "600.5"}, None, None, ERROR),
    ("timeout-word", {"MEMBACKEND_PROBE_TIMEOUT": "soon"}, None, None, ERROR),
    ("trace-under-a-file", {"MEMBACKEND_TRACE": "a-file/trace.jsonl"}, None, None, ERROR),
    ("machine-bad", {"MEMBACKEND_MACHINE__DEVICES": '[{"kind": "tpu"}]'}, None, None, ERROR),
    ("toml-unknown-key", {}, 'backnd = "host"\n', None, ERROR),
    ("toml-size-float", {}, "headroom = 1.5\n", None, ERROR),
    ("toml-bool-as-size", {}, "headroom = true\n", None, ERROR),
    ("toml-int-as-name", {}, "backend = 5\n", None, ERROR),
    ("toml-block-not-names", {}, "block = [1, 2]\n", None, ERROR),
    ("pyproject-bad-name", {}, None, '[tool.membackend]\nbackend = "Not A Name"\n', ERROR),
    ("broken-toml", {}, "backend = \n", None, ERROR),
    ("broken-pyproject", {}, None, "[tool.membackend\n", ERROR),
    ("config-missing", {"MEMBACKEND_CONFIG": "nowhere.toml"}, None, None, ERROR),
]


def _setup(folder: Path, env: dict[str, str], toml: str | None, pyproject: str | None) -> None:
    (folder / "a-file").write_text("")
    (folder / "elsewhere.toml").write_text('backend = "elsewhere"\nsanitize = true\n')
    os.environ.update(env)
    if toml is not None:
        (folder / "membackend.toml").write_text(toml)
    if pyproject is not None:
        (folder / "pyproject.toml").write_text(pyproject)


def _outcome(load):
    """What a load gives: every value and every source, or the error's every part."""
    try:
        s = load()
    except ConfigError as e:
        return ("error", e.key, e.source, e.accepted, str(e))
    values = {k: getattr(s, k) for k in S.FIELDS if k != "machine"}
    keys = [*S.FIELDS, *(f"machine.{k}" for k in S.MACHINE_FIELDS)]
    return ("ok", values, s.machine.model_dump(), {k: s.source_of(k) for k in keys}, s.snapshot())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_quick_and_full_paths_give_the_same_values_sources_and_errors(tmp_path, monkeypatch, case):
    _, env, toml, pyproject, kind = case
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _setup(tmp_path, {}, toml, pyproject)
    full = _outcome(load_settings)
    assert _outcome(quick_settings) == full
    assert (full[0] == "error") is (kind == ERROR), full
    if kind != ERROR:
        assert isinstance(quick_settings(), QuickSettings) is (kind == QUICK)


def test_the_cases_cover_every_kind():
    """The table above is not all one kind: a table that only ever agreed on defaults would prove nothing."""
    kinds = [c[4] for c in CASES]
    assert kinds.count(QUICK) >= 25 and kinds.count(MODEL) >= 3 and kinds.count(ERROR) >= 20


# --------------------------------------------------------------------------- generated inputs

_ASCII = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8)
#: raw values by the key they are tried under; free text too, except for paths (no file outside the folder)
_POOL = {
    "backend": ["host", "vmm", "Not A Name", "cuda-wddm_2", "host\n", ""],
    "sim_profile": ["h200", "nope", "H200"],
    "disable": ["1", "0", "yes", "no", "on", "off", "TRUE", "maybe", "2", " "],
    "sanitize": ["true", "false", "Yes", "perhaps"],
    "block": ["aimdo", "aimdo,vmm", " aimdo , , vmm", "aimdo,host", "Aimdo", ","],
    "headroom": ["0", "512MiB", "1.5GB", "2 GiB", "-1", "lots", "1e3", "0100", "1_000", ".5k"],
    "host_capacity": ["268435456", "1GiB", "12XB", "1Mi"],
    "page_size": ["2097152", "4MiB", "3000", "1024", "2MiB "],
    "probe_timeout": ["2.5", "600", "600.5", "0", "1e1", "soon", "inf", "nan"],
}
_PATHS = ["t.jsonl", "logs/run.jsonl", "a-file/x.jsonl", "a-file"]
_MACHINE_POOL = {"os": ["linux", "Windows", "beos"], "cpus": ["4", "0", "x"], "ram_total": ["64GiB", "lots"],
                 "devices": ['[{"kind": "cuda", "total_memory": "6GiB"}]', '[{"kind": "tpu"}]', "[", "[]"]}


def _raw(key: str) -> st.SearchStrategy:
    if key == "trace":
        return st.sampled_from(_PATHS)
    return st.one_of(st.sampled_from(_POOL[key]), _ASCII)


_env = st.dictionaries(
    st.sampled_from([*_POOL, "trace", "machine.os", "machine.cpus", "machine.devices", "machine", "config", "foo",
                     "lower:backend"]),
    st.none(), max_size=5).flatmap(lambda keys: st.fixed_dictionaries({k: _env_value(k) for k in keys}))


def _env_value(key: str) -> st.SearchStrategy:
    if key.startswith("machine."):
        return st.sampled_from(_MACHINE_POOL[key.split(".")[1]])
    if key == "machine":
        return st.sampled_from(['{"os": "linux"}', "x", '{"gpus": 1}', "[1]"])
    if key == "config":
        return st.sampled_from(["elsewhere.toml", "nowhere.toml", "a-file"])
    if key == "foo":
        return _ASCII
    return _raw(key.removeprefix("lower:"))


def _variable(key: str) -> str:
    if key.startswith("machine."):
        return "MEMBACKEND_MACHINE__" + key.split(".")[1].upper()
    if key.startswith("lower:"):
        return "membackend_" + key.removeprefix("lower:")
    return "MEMBACKEND_" + key.upper()


_toml_scalar = st.one_of(st.integers(-3, 1 << 40), st.floats(allow_nan=False, allow_infinity=False, width=32),
                         st.booleans(), _ASCII, st.lists(_ASCII, max_size=3))
_file = st.dictionaries(
    st.sampled_from([*_POOL, "trace", "machine", "cuda_wddm", "backnd"]), st.none(), max_size=5).flatmap(
    lambda keys: st.fixed_dictionaries({k: _file_value(k) for k in keys}))


def _file_value(key: str) -> st.SearchStrategy:
    if key == "trace":
        return st.sampled_from(_PATHS)
    if key == "machine":
        return st.dictionaries(st.sampled_from(["os", "cpus", "ram_total", "gpus"]), st.sampled_from(
            ["linux", "Windows", 4, 0, "64GiB", True]), max_size=2)
    if key == "cuda_wddm":
        return st.one_of(st.dictionaries(st.sampled_from(["headroom", "hedroom"]), _toml_scalar, max_size=2),
                         _toml_scalar)
    if key == "backnd":
        return _toml_scalar
    return st.one_of(st.sampled_from(_POOL[key]), _toml_scalar)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # printable ASCII: a JSON string is a TOML basic string
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def _toml(table: dict, header: str = "") -> str:
    lines = [f"[{header}]"] if header else []
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if k not in tables]
    for k, sub in tables.items():
        lines.append(f"[{header + '.' if header else ''}{k}]")
        lines += [f"{sk} = {_toml_value(sv)}" for sk, sv in sub.items()]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _isolated():
    """A fresh folder as the current directory, and no MEMBACKEND_* variables (all restored after)."""
    saved, cwd = dict(os.environ), os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        try:
            for k in [k for k in os.environ if k.upper().startswith("MEMBACKEND_")]:
                del os.environ[k]
            os.chdir(folder)
            yield Path(folder)
        finally:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(saved)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(env=_env, toml=st.one_of(st.none(), _file), pyproject=st.one_of(st.none(), _file))
def test_for_generated_environments_and_files_both_paths_agree(env, toml, pyproject):
    with _isolated() as folder:
        _setup(folder, {_variable(k): v for k, v in env.items()}, None if toml is None else _toml(toml),
               None if pyproject is None else _toml(pyproject, "tool.membackend"))
        full = _outcome(load_settings)
        quick = _outcome(quick_settings)
        assert quick == full
        event(f"{full[0]}: {full[1] if full[0] == 'error' else type(quick_settings()).__name__}")
        if full[0] == "ok":
            assert isinstance(quick_settings(), QuickSettings) is (full[2] == S.MachineOverrides().model_dump())


# --------------------------------------------------------------------------- what the quick path costs and is


def test_plain_settings_are_read_without_importing_pydantic(tmp_path):
    (tmp_path / "membackend.toml").write_text('block = ["aimdo"]\nheadroom = "4KiB"\n[cuda_wddm]\nheadroom = 1\n')
    (tmp_path / "pyproject.toml").write_text('[tool.membackend]\nsanitize = true\n')
    code = ("import json, sys; from membackend._settings import quick_settings; s = quick_settings(); "
            "print(json.dumps([type(s).__name__, s.backend, s.block, s.headroom, s.sanitize, s.probe_timeout, "
            "s.source_of('headroom'), sorted(m for m in sys.modules if m.startswith('pydantic'))]))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env = {**clean, "MEMBACKEND_BACKEND": "host", "MEMBACKEND_PROBE_TIMEOUT": "5"}
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["QuickSettings", "host", ["aimdo"], 4096, True, 5.0, "membackend.toml", []]


@pytest.mark.parametrize("kwargs", [{}, {"exclude_none": True}, {"exclude": {"devices"}},
                                    {"exclude": {"devices"}, "exclude_none": False}, {"mode": "json"}])
def test_no_machine_overrides_answers_like_an_empty_machineoverrides(kwargs):
    ours, theirs = quick_settings().machine, S.MachineOverrides()
    assert ours.model_dump(**kwargs) == theirs.model_dump(**kwargs)
    assert all(getattr(ours, k) is None for k in S.MACHINE_FIELDS)
    assert ours.model_fields_set == theirs.model_fields_set  # anything else: the real model answers


def test_full_is_the_equal_settings_and_reads_neither_environment_nor_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "host")
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "4096")
    q = quick_settings()
    assert isinstance(q, QuickSettings)
    full = load_settings()
    assert q.full() == full and q.model_dump() == full.model_dump()  # model_dump: answered by full()
    assert q.full().model_fields_set == full.model_fields_set == {"backend", "headroom"}
    assert isinstance(q.full(), S.Settings) and q.full().source_of("headroom") == "env MEMBACKEND_HEADROOM"
    fresh = QuickSettings({k: getattr(q, k) for k in S.FIELDS if k != "machine"})
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "8192")  # later changes do not leak into the values
    (tmp_path / "membackend.toml").write_text("[machine]\ncpus = 3\n")
    assert fresh.full().headroom == 4096 and fresh.full().machine.cpus is None


def test_a_platform_reads_its_settings_from_the_quick_path_s_reading(monkeypatch):
    from membackend.platform import Platform, PlatformSetting, size
    from membackend.types import Candidate

    p = Platform(name="quickly", probe=lambda m: Candidate("quickly", 0, "-"),
                 settings=(PlatformSetting("headroom", parse=size, default=0),))
    monkeypatch.setenv("MEMBACKEND_QUICKLY_HEADROOM", "1MiB")
    q = quick_settings()
    monkeypatch.setenv("MEMBACKEND_QUICKLY_HEADROOM", "2MiB")  # after the reading: not seen
    values = p.setting_values(q)
    assert (values["headroom"], values.source("headroom")) == (1 << 20, "env MEMBACKEND_QUICKLY_HEADROOM")
    assert values == p.setting_values(q.full())
