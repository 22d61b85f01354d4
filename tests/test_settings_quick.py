"""quick_settings (the start-up path without pydantic) against load_settings: for every input, valid or
not, in plain form or not, both give the same values or raise the same ConfigError; plain inputs are
served without pydantic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from membackend import _settings as S
from membackend._settings import QuickSettings, load_settings, quick_settings
from membackend.types import ConfigError

PLAIN, FULL = True, False

#: (id, environment, membackend.toml, pyproject.toml, whether the quick path takes it itself)
CASES = [
    ("defaults", {}, None, None, PLAIN),
    ("backend", {"MEMBACKEND_BACKEND": "host"}, None, None, PLAIN),
    ("backend-dash", {"MEMBACKEND_BACKEND": "cuda-wddm_2"}, None, None, PLAIN),
    ("disable-1", {"MEMBACKEND_DISABLE": "1"}, None, None, PLAIN),
    ("disable-no", {"MEMBACKEND_DISABLE": "no"}, None, None, PLAIN),
    ("flags", {"MEMBACKEND_DISABLE": "false", "MEMBACKEND_SANITIZE": "yes"}, None, None, PLAIN),
    ("block", {"MEMBACKEND_BLOCK": " aimdo , vmm,, "}, None, None, PLAIN),
    ("block-empty", {"MEMBACKEND_BLOCK": ""}, None, None, PLAIN),
    ("sizes", {"MEMBACKEND_HEADROOM": "0", "MEMBACKEND_HOST_CAPACITY": "268435456"}, None, None, PLAIN),
    ("page", {"MEMBACKEND_PAGE_SIZE": "2097152"}, None, None, PLAIN),
    ("timeout", {"MEMBACKEND_PROBE_TIMEOUT": "2.5"}, None, None, PLAIN),
    ("timeout-max", {"MEMBACKEND_PROBE_TIMEOUT": "600"}, None, None, PLAIN),
    ("profile", {"MEMBACKEND_SIM_PROFILE": "h200"}, None, None, PLAIN),
    ("trace", {"MEMBACKEND_TRACE": "logs/run.jsonl"}, None, None, PLAIN),
    ("other-vars", {"MEMBACKEND_WDDM_HEADROOM": "x", "MEMBACKEND_FOO": "1"}, None, None, PLAIN),
    ("toml", {}, 'backend = "vmm"\ndisable = true\nblock = ["aimdo"]\nheadroom = 1048576\nprobe_timeout = 3\n'
                 'page_size = "4194304"\ntrace = "t.jsonl"\n', None, PLAIN),
    ("toml-block-text", {}, 'block = "aimdo,vmm"\nsanitize = "1"\n', None, PLAIN),
    ("pyproject", {}, None, '[project]\nname = "x"\n[tool.membackend]\nbackend = "frompyproject"\n', PLAIN),
    ("comfyui-pyproject", {}, None, '[project]\nname = "comfyui"\n[tool.ruff]\nline-length = 120\n', PLAIN),
    ("precedence", {"MEMBACKEND_BACKEND": "fromenv"}, 'backend = "fromtoml"\nheadroom = 7\n',
     '[tool.membackend]\nbackend = "frompyproject"\nheadroom = 9\nsanitize = true\n', PLAIN),
    # valid, but not in plain form: load_settings answers
    ("units", {"MEMBACKEND_HEADROOM": "512MiB"}, None, None, FULL),
    ("on", {"MEMBACKEND_DISABLE": "on"}, None, None, FULL),
    ("TRUE", {"MEMBACKEND_SANITIZE": "TRUE"}, None, None, FULL),
    ("timeout-exp", {"MEMBACKEND_PROBE_TIMEOUT": "1e1"}, None, None, FULL),
    ("leading-zero", {"MEMBACKEND_HEADROOM": "0100"}, None, None, FULL),
    ("underscore", {"MEMBACKEND_HOST_CAPACITY": "1_000"}, None, None, FULL),
    ("machine", {"MEMBACKEND_MACHINE__OS": "Windows"}, None, None, FULL),
    ("machine-json", {"MEMBACKEND_MACHINE": '{"cpus": 4}'}, None, None, FULL),
    ("machine-toml", {}, "[machine]\nos = \"linux\"\n", None, FULL),
    ("lower-case-var", {"membackend_backend": "host"}, None, None, FULL),
    ("toml-size-float", {}, "headroom = 1.5\n", None, FULL),
    ("toml-page-units", {}, 'page_size = "4MiB"\n', None, FULL),
    # invalid: the same ConfigError from both
    ("bad-name", {"MEMBACKEND_BACKEND": "Not A Name"}, None, None, FULL),
    ("name-newline", {"MEMBACKEND_BACKEND": "host\n"}, None, None, FULL),
    ("empty-name", {"MEMBACKEND_BACKEND": ""}, None, None, FULL),
    ("bad-flag", {"MEMBACKEND_DISABLE": "2"}, None, None, FULL),
    ("block-host", {"MEMBACKEND_BLOCK": "aimdo,host"}, None, None, FULL),
    ("block-bad", {"MEMBACKEND_BLOCK": "Aimdo"}, None, None, FULL),
    ("size-words", {"MEMBACKEND_HEADROOM": "lots"}, None, None, FULL),
    ("size-negative", {"MEMBACKEND_HOST_CAPACITY": "-1"}, None, None, FULL),
    ("page-odd", {"MEMBACKEND_PAGE_SIZE": "3000"}, None, None, FULL),
    ("page-small", {"MEMBACKEND_PAGE_SIZE": "1024"}, None, None, FULL),
    ("timeout-zero", {"MEMBACKEND_PROBE_TIMEOUT": "0"}, None, None, FULL),
    ("timeout-big", {"MEMBACKEND_PROBE_TIMEOUT": "600.5"}, None, None, FULL),
    ("timeout-word", {"MEMBACKEND_PROBE_TIMEOUT": "soon"}, None, None, FULL),
    ("trace-under-a-file", {"MEMBACKEND_TRACE": "a-file/trace.jsonl"}, None, None, FULL),
    ("trace-empty", {"MEMBACKEND_TRACE": ""}, None, None, FULL),
    ("machine-bad", {"MEMBACKEND_MACHINE__DEVICES": '[{"kind": "tpu"}]'}, None, None, FULL),
    ("toml-unknown-key", {}, 'backnd = "host"\n', None, FULL),
    ("toml-bool-as-size", {}, "headroom = true\n", None, FULL),
    ("toml-int-as-flag", {}, "disable = 1\n", None, FULL),
    ("toml-int-as-name", {}, "backend = 5\n", None, FULL),
    ("toml-block-not-names", {}, "block = [1, 2]\n", None, FULL),
    ("pyproject-bad-name", {}, None, '[tool.membackend]\nbackend = "Not A Name"\n', FULL),
    ("broken-toml", {}, "backend = \n", None, "error"),
    ("broken-pyproject", {}, None, "[tool.membackend\n", "error"),
    ("config-missing", {"MEMBACKEND_CONFIG": "nowhere.toml"}, None, None, "error"),
    ("config-elsewhere", {"MEMBACKEND_CONFIG": "elsewhere.toml"}, None, None, PLAIN),
]


def _setup(tmp_path: Path, monkeypatch, env, toml, pyproject) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "elsewhere.toml").write_text('backend = "elsewhere"\nsanitize = true\n')
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if toml is not None:
        (tmp_path / "membackend.toml").write_text(toml)
    if pyproject is not None:
        (tmp_path / "pyproject.toml").write_text(pyproject)


def _outcome(load):
    try:
        s = load()
    except ConfigError as e:
        return ("error", e.key, e.source, e.accepted, str(e))
    values = {k: getattr(s, k) for k in S.FIELDS if k != "machine"}
    return ("ok", values, s.machine.model_dump())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_quick_and_full_paths_give_the_same_values_and_the_same_errors(tmp_path, monkeypatch, case):
    _, env, toml, pyproject, how = case
    _setup(tmp_path, monkeypatch, env, toml, pyproject)
    full = _outcome(load_settings)
    quick = _outcome(quick_settings)
    assert quick == full
    if how == "error":
        assert full[0] == "error"
        return
    if full[0] == "ok":
        got = quick_settings()
        # plain inputs are the quick path's own; everything else is load_settings' Settings
        assert isinstance(got, QuickSettings) is (how is PLAIN), type(got)


def test_the_cases_cover_plain_values_other_spellings_and_errors():
    """The table above is not all one kind: a table that only ever deferred would prove nothing."""
    kinds = [c[4] for c in CASES]
    assert kinds.count(PLAIN) >= 15 and kinds.count(FULL) >= 30 and kinds.count("error") >= 3


def test_plain_settings_are_read_without_importing_pydantic(tmp_path):
    (tmp_path / "membackend.toml").write_text('block = ["aimdo"]\nheadroom = 4096\n')
    (tmp_path / "pyproject.toml").write_text('[tool.membackend]\nsanitize = true\n')
    code = ("import json, sys; from membackend._settings import quick_settings; s = quick_settings(); "
            "print(json.dumps([type(s).__name__, s.backend, s.block, s.headroom, s.sanitize, s.probe_timeout, "
            "sorted(m for m in sys.modules if m.startswith('pydantic'))]))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env = {**clean, "MEMBACKEND_BACKEND": "host", "MEMBACKEND_PROBE_TIMEOUT": "5"}
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["QuickSettings", "host", ["aimdo"], 4096, True, 5.0, []]


def test_the_models_fields_and_defaults_are_the_tables_the_quick_path_reads():
    fields = S.Settings.model_fields
    assert tuple(fields) == S.FIELDS and tuple(S.MachineOverrides.model_fields) == S.MACHINE_FIELDS
    assert set(S._PLAIN) == set(S.FIELDS) - {"machine"}
    for name, default in S.DEFAULTS.items():
        assert fields[name].default == default, name
    assert fields["block"].default_factory() == []


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
    assert isinstance(q.full(), S.Settings)
    fresh = QuickSettings({k: getattr(q, k) for k in S.FIELDS if k != "machine"})
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "8192")  # later changes do not leak into the values
    (tmp_path / "membackend.toml").write_text("[machine]\ncpus = 3\n")
    assert fresh.full().headroom == 4096 and fresh.full().machine.cpus is None
