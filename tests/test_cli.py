"""``membackend doctor | backends | budget``: output, --json and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from membackend import _cli as cli
from membackend._session import Session


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_doctor_passes_its_self_test(capsys):
    code, out, _ = run(capsys, "doctor")
    assert code == 0
    assert "selected: host (fallback)" in out and "self-test: passed" in out
    assert "budgets:" in out and ("from psutil MemAvailable" in out or "cgroup" in out)
    for step in ("baseline", "budget", "reserve", "fault", "free", "release", "close"):
        assert step in out


@pytest.mark.parametrize("setting, words", [(None, "auto: the weights of models ComfyUI drops stay in VRAM as the "
                                                  "room allows"),
                                            ("off", "off: a model ComfyUI drops gives its memory back at once"),
                                            ("3GiB", "3.0 GiB: the weights of models ComfyUI drops stay in VRAM at most 3"
                                                     ".0 GiB per device")])
def test_doctor_says_what_the_cache_of_dropped_weights_may_keep(capsys, monkeypatch, setting, words):
    if setting is not None:
        monkeypatch.setenv("MEMBACKEND_KEEP_DROPPED", setting)
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and f"cache of dropped weights: {words}" in out, out.splitlines()[-1]
    code, out, _ = run(capsys, "doctor", "--json")
    assert json.loads(out)["cache"]["keep_dropped"] == ("auto" if setting is None else
                                                        "off" if setting == "off" else 3 << 30)


def test_doctor_json(capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    data = json.loads(out)
    assert code == 0 and data["selected"] == "host" and data["how"] == "fallback"
    assert data["selftest"]["ok"] and [s["step"] for s in data["selftest"]["steps"]] == [
        "baseline", "budget", "reserve", "fault", "free", "release", "close"]
    fault = data["selftest"]["steps"][3]
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
    assert code == 2 and "backend 'no_such_backend' is not installed (installed: " in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_misspelt_forced_backend_gets_one_line_with_the_closest_name(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmn")
    code, _, err = run(capsys, "doctor")
    assert code == 2 and err.strip().splitlines() == [
        "membackend: configuration error: backend 'vmn' is not installed; did you mean vmm? (installed: "
        + err.split("(installed: ")[1].strip()]


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


def test_the_doctor_and_the_budget_close_every_session_they_open(capsys, monkeypatch):
    opened, closed = [], []
    real_init, real_close = Session.__init__, Session.close

    def init(self, *args, **kwargs):
        opened.append(id(self))
        real_init(self, *args, **kwargs)

    def close(self):
        closed.append(id(self))
        real_close(self)

    monkeypatch.setattr(Session, "__init__", init)
    monkeypatch.setattr(Session, "close", close)
    for command in ("doctor", "budget"):
        code, _, _ = run(capsys, command)
        assert code == 0
    assert len(opened) == 3 and sorted(opened) == sorted(closed), (opened, closed)


def test_a_self_test_failure_prints_the_kit_s_own_message(capsys, monkeypatch):
    """The doctor judges as the kit does: a host backend whose budget claims more free memory than the
    machine has fails the self-test's budget step with the kit's words, not an RSS figure."""
    from membackend._backends.host import HostBackend
    from membackend.types import Budget

    real = HostBackend.membackend_budget_query

    def inflated(self, device):
        b = real(self, device)
        return Budget.of(b.total, b.total, b.headroom, b.source)

    monkeypatch.setattr(HostBackend, "membackend_budget_query", inflated)
    monkeypatch.setattr(HostBackend.membackend_budget_query, "membackend_impl", real.membackend_impl, raising=False)
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "self-test: FAILED" in out, out
    line = next(x for x in out.splitlines() if "FAIL budget" in x)
    assert "but /proc/meminfo MemTotal, MemAvailable says at most" in line, line


def test_the_doctor_runs_its_self_test_in_an_install_without_pytest(tmp_path):
    """The self-test runs the kit's checks (membackend.testing.harness), which need no pytest: only the kit
    extra brings it."""
    code = ("import sys\n"
            "class NoPytest:\n"  # as if not installed: importing it raises ModuleNotFoundError
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pytest', '_pytest', 'hypothesis'): raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, NoPytest())\n"
            "from membackend import _cli\n"
            "rc = _cli.main(['doctor'])\n"
            "assert 'pytest' not in sys.modules\n"
            "sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "self-test: passed" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "membackend._cli", "backends"], capture_output=True, text=True)
    assert proc.returncode == 0 and "host" in proc.stdout


def test_forcing_a_gpu_backend_on_a_machine_without_its_device_is_a_configuration_error(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    monkeypatch.setenv("MEMBACKEND_MACHINE__DEVICES", "[]")  # no GPU, whatever this machine has
    for command in ("doctor", "budget", "backends"):
        code, out, err = run(capsys, command)
        assert code == 2 and out == "", (command, out)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "membackend: configuration error: backend 'vmm' cannot be used here: it serves cuda devices and this "
            "machine has none; its probe says: no CUDA or HIP device found; choices here: "), (command, err)
        choices, _, source = lines[0].rpartition("choices here: ")[2].partition("; the name is from ")
        assert "host" in choices.split(", ") and source == "env MEMBACKEND_BACKEND", (command, err)


def test_the_doctor_suggests_forcing_only_what_forcing_would_accept_here(capsys, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "h200")  # CUDA only: the HIP platforms serve no device here
    code, out, _ = run(capsys, "backends")
    line = next(x for x in out.splitlines() if x.startswith("  to force another: "))
    choices = line.rpartition("choices: ")[2].split(", ")
    assert code == 0 and "host" in choices, line
    # vmm is the selection; the HIP platforms serve no device here; cuda_wddm and unified_gb10 are turned down by
    # their probes (not Windows, not integrated), and comfy-aimdo cannot drive a simulated GPU
    assert not {"vmm", "rocm_linux", "rocm_windows", "cuda_wddm", "unified_gb10", "aimdo"} & set(choices), line
    for name in choices:  # each one it names is accepted
        monkeypatch.setenv("MEMBACKEND_BACKEND", name)
        assert run(capsys, "backends")[0] == 0, name


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
    assert machine["discovery"] == ["cuda (sim:gb10-128gb): 1 device(s), driver 13.0 (cuDriverGetVersion)",
                                    "cuda (sim:gb10-128gb): device memory: memory of this process (memfd_create, "
                                    "mmap): the bytes a GPU would hold"]


def test_doctor_says_why_a_real_driver_listed_nothing(capsys):
    code, out, _ = run(capsys, "doctor")
    assert "discovery:" in out and "cuda" in out.split("discovery:")[1]


# --------------------------------------------------------------------------- membackend --help


def test_help_lists_every_command_with_a_plain_one_line_description(capsys):
    import argparse

    import pytest

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"doctor", "backends", "budget", "comfyui", "replay", "bench"}
    described = {c.dest: c.help for c in sub._choices_actions}
    for name in sub.choices:
        assert described.get(name), f"{name} has no description"
        line = next((ln for ln in out.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None and described[name] in line, (name, out)  # on one line, beside its name
    for text in [out] + [p.format_help() for p in sub.choices.values()]:
        assert "``" not in text and ":class:" not in text and ":func:" not in text  # no RST markup


# --------------------------------------------------------------------------- replay takes any file

GiB = 1 << 30
_HEADER = {"event": "trace", "format": "membackend-trace", "version": 1, "sim_profile": "h200"}
_REGISTER = {"event": "register", "policy": "membackend", "model": "m", "bytes": GiB, "devices": ["cuda:0"]}
_FAULT = {"event": "fault", "policy": "membackend", "model": "m", "device": "cuda:0", "offset": 0, "bytes": GiB}


def _trace(tmp_path, *lines, name="bad.jsonl"):
    raw = [json.dumps(x).encode() if isinstance(x, dict) else x.encode() if isinstance(x, str) else x for x in lines]
    path = tmp_path / name
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def _exits_2(capsys, *argv):
    """Run the CLI; it must exit 2 with one line on stderr (never a traceback); return that line."""
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def test_replay_of_a_deeply_nested_line_exits_2_naming_it(tmp_path, capsys):
    path = _trace(tmp_path, _HEADER, "[" * 100_000 + "]" * 100_000)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 2: nested too deeply" in line and "flat JSON object" in line


def test_replay_of_bytes_that_are_not_utf8_exits_2_naming_the_line(tmp_path, capsys):
    path = _trace(tmp_path, _HEADER, _REGISTER, b'{"event": "use", "policy": "x", "models": ["\xe9"]}')
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 3: not UTF-8 (byte 0xe9" in line and "UTF-8 text" in line


def test_replay_of_a_5000_digit_integer_exits_2_naming_the_line(tmp_path, capsys):
    path = _trace(tmp_path, _HEADER, json.dumps(_REGISTER).replace(str(GiB), "7" * 5000))
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 2: a number with more than" in line and "2**63 - 1" in line


def test_replay_of_a_header_scenario_of_the_wrong_type_exits_2(tmp_path, capsys):
    path = _trace(tmp_path, dict(_HEADER, scenario=["hook-unload"]), _REGISTER)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1: header 'scenario' must be a non-empty string or null" in line


def test_replay_of_a_header_machine_of_the_wrong_type_exits_2(tmp_path, capsys):
    path = _trace(tmp_path, dict(_HEADER, machine=["device_memory", 1]), _REGISTER)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1: header 'machine' must be an object of profile fields" in line


def test_replay_of_a_negative_device_memory_exits_2(tmp_path, capsys):
    path = _trace(tmp_path, dict(_HEADER, machine={"device_memory": -1}), _REGISTER)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1: header 'machine' field 'device_memory' must be a whole number of bytes from 1" in line


def test_replay_of_a_machine_field_no_profile_has_exits_2_with_the_accepted_ones(tmp_path, capsys):
    path = _trace(tmp_path, dict(_HEADER, machine={"warp_drive": 9}), _REGISTER, _FAULT)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1 (the header): 'machine' field 'warp_drive' is not a profile field" in line
    assert "accepted: " in line and "device_memory" in line and "pagein_seconds" in line


def test_replay_of_version_true_exits_2(tmp_path, capsys):
    path = _trace(tmp_path, dict(_HEADER, version=True), _REGISTER)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1: trace version true is not supported; accepted: 1" in line


def test_replay_of_an_unknown_backend_exits_2_naming_the_header(tmp_path, capsys, monkeypatch):
    ran = []
    import membackend.lab._replay.compare as compare

    monkeypatch.setattr(compare, "run_side", lambda *a, **k: ran.append(a))
    path = _trace(tmp_path, dict(_HEADER, backend="nosuch"), _REGISTER)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1 (the header): header 'backend': backend 'nosuch' is not installed" in line
    assert "installed: " in line and "vmm" in line and "--backend" in line
    assert ran == []  # refused before any side ran


def test_replay_of_an_unknown_header_profile_exits_2_naming_the_header(tmp_path, capsys):
    path = _trace(tmp_path, dict(_HEADER, sim_profile="rtx-9090"), _REGISTER)
    line = _exits_2(capsys, "replay", str(path))
    assert f"{path}, line 1 (the header): header 'sim_profile' 'rtx-9090' is no simulated profile" in line
    assert "accepted: wddm-6gb" in line


def test_replay_of_no_such_file_says_so(tmp_path, capsys):
    line = _exits_2(capsys, "replay", "nosuch.jsonl")
    assert line.startswith("membackend: nosuch.jsonl: no such file; accepted: the path of a trace file")
    line = _exits_2(capsys, "replay", str(tmp_path / "runs" / "a.jsonl"))
    assert "a.jsonl: no such file" in line
    assert "no built-in scenario 'nosuch'" in _exits_2(capsys, "replay", "nosuch")  # a plain word: a scenario name


class _FillsUp:
    """A text file on a disk with ``room`` characters left: a write past it fails as a full disk does."""

    def __init__(self, f, room):
        self._f, self.room = f, room

    def write(self, text):
        import errno
        import os

        if len(text) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(text)
        return self._f.write(text)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _watch_sim(monkeypatch):
    """Every simulated driver and ledger the replay makes, to look at after it."""
    import membackend.lab._replay.engine as engine

    drivers, ledgers = [], []
    real_open = engine.open_sim_variant

    def open_sim_variant(*a, **k):
        drivers.append(real_open(*a, **k))
        return drivers[-1]

    class Ledger(engine.Ledger):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            ledgers.append(self)
    monkeypatch.setattr(engine, "open_sim_variant", open_sim_variant)
    monkeypatch.setattr(engine, "Ledger", Ledger)
    return drivers, ledgers


def test_a_record_file_on_a_full_disk_exits_2_naming_it_and_releases_everything(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from membackend.types import Device

    target = tmp_path / "rec.jsonl"
    real_open = Path.open
    files = []

    def open_(self, mode="r", *a, **k):
        f = real_open(self, mode, *a, **k)
        if self == target and "a" in mode:
            files.append(_FillsUp(f, room=30_000))  # the header and a few hundred lines fit, then the disk is full
            return files[-1]
        return f
    monkeypatch.setattr(Path, "open", open_)
    drivers, ledgers = _watch_sim(monkeypatch)
    line = _exits_2(capsys, "replay", "hook-unload", "--policy", "plugin", "--record", str(target))
    assert line == (f"membackend: cannot write the trace {str(target)!r}: No space left on device; accepted: a file "
                    "in a folder this process may write to, on a disk with room for it")
    said = line.split(": ", 1)[1]
    assert "vmm" not in said and "backend" not in said and "Driver" not in said  # the file's failure, not the backend's
    assert files and files[0].room < 1000  # it failed in the middle of the run
    sim = drivers[-1].sim
    assert sim.faults.calls.get("cuMemAddressReserve", 0) > 0  # reservations were made before the disk filled up
    assert all(sim.state(i)["reserved"] == 0 and sim.state(i)["physical"] == 0 for i in range(len(sim.devices)))
    assert ledgers and all(lg.account(Device("cuda", 0)).reservations_alive == 0 for lg in ledgers)
    assert not target.exists()  # what was written of it is no trace


def test_a_record_file_that_cannot_be_opened_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    import errno
    from pathlib import Path

    target = tmp_path / "ro.jsonl"
    real_open = Path.open

    def open_(self, mode="r", *a, **k):
        if self == target:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, mode, *a, **k)
    monkeypatch.setattr(Path, "open", open_)
    drivers, ledgers = _watch_sim(monkeypatch)
    line = _exits_2(capsys, "replay", "hook-unload", "--policy", "plugin", "--record", str(target))
    assert f"cannot write the trace {str(target)!r}: Permission denied" in line
    assert all(d.sim.state(0)["reserved"] == 0 for d in drivers)


def test_recording_to_dev_full_exits_2_and_leaves_the_device_alone(capsys, monkeypatch):
    import os
    import stat
    from pathlib import Path

    import pytest

    if not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)):
        pytest.skip("no /dev/full device here")
    real_unlink = Path.unlink

    def unlink(self, *a, **k):  # a replay must never remove a device node (as root it could)
        if str(self) == "/dev/full":
            raise AssertionError("the replay tried to remove /dev/full")
        return real_unlink(self, *a, **k)
    monkeypatch.setattr(Path, "unlink", unlink)
    line = _exits_2(capsys, "replay", "hook-unload", "--policy", "plugin", "--record", "/dev/full")
    assert "cannot write the trace '/dev/full': No space left on device" in line
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


# --------------------------------------------------------------------------- pip install membackend (no extras)

_BLOCK_BINDINGS = """
import sys

class NoBindings:  # what an environment without cuda-python and hip-python answers
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cuda", "hip"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoBindings())
from membackend._cli import main
code = main(sys.argv[1:])
assert not any(m.split(".")[0] in ("cuda", "hip") for m in sys.modules), "a binding was imported"
sys.exit(code)
"""


@pytest.mark.long  # a subprocess replay without the driver bindings
def test_replay_runs_where_cuda_python_and_hip_python_are_not_installed(tmp_path):
    import pytest

    from membackend.lab._replay.traceformat import write_trace

    events = [{"event": "register", "model": "m", "bytes": 4 * GiB, "devices": ["cuda:0"]},
              {"event": "use", "models": ["m"]}]
    events += [{"event": e, "model": "m", "device": "cuda:0", "offset": off * GiB, "bytes": GiB, "seconds": 0.01}
               for off in range(4) for e in ("fault", "copy", "unpin")]
    events += [{"event": "unload_all"}]
    cuda_trace = write_trace(tmp_path / "cuda.jsonl", events, sim_profile="wddm-6gb")
    hip_trace = write_trace(tmp_path / "hip.jsonl", [dict(e, **({"device": "hip:0"} if "device" in e else {}),
                                                          **({"devices": ["hip:0"]} if "devices" in e else {}))
                                                     for e in events], sim_profile="rocm-win-2gpu")
    script = tmp_path / "no_bindings.py"
    script.write_text(_BLOCK_BINDINGS)
    for trace, backend in ((cuda_trace, "cuda_wddm"), (hip_trace, "rocm_windows")):
        proc = subprocess.run([sys.executable, str(script), "replay", str(trace), "--backend", backend, "--json"],
                              capture_output=True, text=True, timeout=600)
        if "No module named 'membackend_" in proc.stderr:
            pytest.skip("the platform plugins are not installed")
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["backends"] == {"stock": "aimdo_stock", "plugin": backend}
        assert data["figures"]["loaded"]["plugin"] == 4 * GiB and data["violations"] == []
    # a seed scenario on a CUDA profile, its backend chosen by selection: the simulated driver needs no binding
    proc = subprocess.run([sys.executable, str(script), "replay", "hook-unload", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["backends"]["plugin"] not in ("aimdo", "host")


def test_the_stand_in_cuda_types_replay_exactly_as_cuda_python_does(monkeypatch):
    """The simulation over its own types gives the same figures as over cuda-python's."""
    import pytest

    pytest.importorskip("cuda.bindings.driver")
    import membackend._drivers.sim.cuda as sim_cuda
    from membackend.lab._replay.compare import replay

    with_bindings = replay("churn-wddm", seeds=1).to_json()
    monkeypatch.setattr(sim_cuda, "_bindings", lambda: sim_cuda.STAND_IN_TYPES)
    stand_in = replay("churn-wddm", seeds=1)
    assert stand_in.to_json()["figures"] == with_bindings["figures"]
    assert stand_in.results["plugin"][0].bugchecks == 0 and stand_in.results["stock"][0].bugchecks > 0


def test_the_stand_in_cuda_types_carry_cuda_pythons_names_and_values():
    import enum

    import pytest

    real = pytest.importorskip("cuda.bindings.driver")
    from membackend._drivers.sim.cuda import STAND_IN_TYPES

    checked = 0
    for name, ours in vars(STAND_IN_TYPES).items():
        theirs = getattr(real, name)
        if isinstance(ours, type) and issubclass(ours, enum.Enum):
            for member in ours:
                assert int(getattr(theirs, member.name)) == int(member), f"{name}.{member.name}"
                checked += 1
        elif hasattr(ours, "__int__"):  # a handle: built from an int, int() gives it back
            assert int(theirs(7)) == int(ours(7)) == 7 and repr(theirs(7)) == repr(ours(7))
            assert (theirs(7) == theirs(7)) == (ours(7) == ours(7)) and (theirs(7) == 7) == (ours(7) == 7)
        else:  # a struct: every field we set exists on theirs, with the same default
            for field, value in vars(ours()).items():
                default = getattr(theirs(), field)
                if isinstance(value, (int, enum.Enum)):
                    assert int(default) == int(value), f"{name}.{field}"
                else:  # a nested struct (a CUmemLocation)
                    for inner, v in vars(value).items():
                        assert int(getattr(default, inner)) == int(v), f"{name}.{field}.{inner}"
    assert checked >= 40


@pytest.mark.long  # every command, each in a subprocess
def test_every_command_refuses_a_size_with_thousands_of_digits_in_one_short_line(tmp_path):
    huge = "9" * 5000
    env = {**__import__("os").environ, "MEMBACKEND_HEADROOM": huge, "MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA": huge}
    for argv in (["doctor"], ["doctor", "--json"], ["backends"], ["budget"], ["budget", "--json"]):
        # 400 digits parsed before, then the doctor's float division ended in an OverflowError traceback
        proc = subprocess.run([sys.executable, "-m", "membackend._cli", *argv], capture_output=True, text=True,
                              env={**env, "MEMBACKEND_HEADROOM": "9" * 400}, cwd=tmp_path, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
        assert "is not a size (too many digits" in proc.stderr and len(proc.stderr) < 2000, (argv, proc.stderr[:500])
        proc = subprocess.run([sys.executable, "-m", "membackend._cli", *argv], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
        assert "is not a size (too many digits" in proc.stderr and len(proc.stderr) < 2000, (argv, proc.stderr[:500])
    proc = subprocess.run([sys.executable, "-m", "membackend._cli", "replay", "hook-unload", "--seeds", huge],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "from 1 to 1,000,000" in proc.stderr and len(proc.stderr) < 2000, proc.stderr[:500]
