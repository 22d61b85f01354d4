"""A trace (``MEMBACKEND_TRACE``) on a full disk.

A trace that cannot be written at session creation is refused up front: a ``ConfigError`` for the
``trace`` setting naming the path and what is accepted. A disk that fills up later is the tracer's
failure, never the backend's: tracing stops with one warning and every memory operation goes on
(G6) -- no ``PluginError``, nothing leaked."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from membackend._manager import BackendManager
from membackend._residency import ResidencyManager
from membackend._settings import load_settings
from membackend.types import ConfigError, Device, MembackendError, PluginError

MiB = 1 << 20


class _FillsUp:
    """A text file on a disk with ``room`` characters left: a write past it fails as a full disk does."""

    def __init__(self, f, room):
        self._f, self.room, self.refused = f, room, 0

    def write(self, text):
        if len(text) > self.room:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(text)
        return self._f.write(text)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _disk_with_room(monkeypatch, target: Path, room: int) -> list[_FillsUp]:
    """Opening ``target`` for appending gives a file with ``room`` characters left on its disk."""
    real_open = Path.open
    files: list[_FillsUp] = []

    def open_(self, mode="r", *a, **k):
        f = real_open(self, mode, *a, **k)
        if self == target and "a" in mode:
            files.append(_FillsUp(f, room))
            return files[-1]
        return f
    monkeypatch.setattr(Path, "open", open_)
    return files


def _refused_at_creation(path: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        BackendManager(load_settings(trace=path)).session()
    exc = info.value
    message = str(exc)
    assert exc.key == "trace" and "\n" not in message
    assert repr(path) in message and "No space left on device" in message and "accepted: " in message
    assert not isinstance(exc, PluginError)
    return exc


@pytest.mark.skipif(not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)),
                    reason="no /dev/full device here")
def test_a_trace_at_dev_full_is_refused_at_session_creation():
    _refused_at_creation("/dev/full")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # a device is written to, never replaced


def test_a_trace_whose_header_does_not_fit_is_refused_at_session_creation(tmp_path, monkeypatch):
    target = tmp_path / "run.jsonl"
    files = _disk_with_room(monkeypatch, target, room=0)
    exc = _refused_at_creation(str(target))
    assert exc.source  # where the setting came from (kwargs here)
    assert files and all(f.closed for f in files)  # nothing left open


def test_the_cli_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    """``membackend budget`` (any command that opens a session) with an unwritable trace: exit 2, one line."""
    from membackend import _cli

    target = tmp_path / "run.jsonl"
    _disk_with_room(monkeypatch, target, room=0)
    monkeypatch.setenv("MEMBACKEND_TRACE", str(target))
    try:
        rc = _cli.main(["budget"])
    except SystemExit as exc:  # pragma: no cover - the CLI returns its code
        rc = exc.code
    err = capsys.readouterr().err.strip()
    if rc == 0:  # this command opens no session here: nothing traced, nothing to refuse
        pytest.skip("'membackend budget' opens no session on this machine")
    assert rc == 2 and "\n" not in err and str(target) in err and "No space left on device" in err


def test_a_disk_that_fills_up_mid_run_stops_the_trace_and_the_verbs_go_on(tmp_path, monkeypatch, caplog):
    target = tmp_path / "run.jsonl"
    files = _disk_with_room(monkeypatch, target, room=1_000)  # the header and a line or two fit
    session = BackendManager(load_settings(trace=str(target))).session()
    caplog.set_level(logging.WARNING)
    try:
        rs = []
        for _ in range(6):  # enough verb calls to fill the disk
            r = session.reserve("cpu", 4 * MiB)
            assert session.fault(r, 0, 2 * MiB).ok
            assert session.free(r) == 2 * MiB
            rs.append(r)
        session.budget_query("cpu")
        for r in rs:
            session.release_reservation(r)
        assert files[-1].refused >= 1  # the disk did fill up (files[0]: the settings checking it opens)
        assert session.ledger.account(Device("cpu", 0)).reservations_alive == 0
        tracer = session.tracer
        assert isinstance(tracer.failed, OSError) and tracer.failed.errno == errno.ENOSPC
        tracer.event("anything", policy="membackend")  # a policy's record after the failure: dropped, no raise
    finally:
        session.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "trace" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    said = warnings[0].getMessage()
    assert str(target) in said and "No space left on device" in said
    lines = target.read_text().splitlines()
    assert json.loads(lines[0])["event"] == "trace"  # what fitted stays


def test_the_residency_policy_goes_on_when_the_trace_fills_up(tmp_path, monkeypatch):
    target = tmp_path / "run.jsonl"
    _disk_with_room(monkeypatch, target, room=600)
    session = BackendManager(load_settings(trace=str(target))).session()
    try:
        policy = ResidencyManager(session)
        models = [policy.register(f"m{i}", 8 * MiB, ["cpu"]) for i in range(3)]
        policy.use(models, workflow="w")
        for m in models:
            assert policy.fault(m, 0, 4 * MiB).ok
        policy.unload_all()
        assert session.tracer.failed is not None
    except MembackendError as exc:  # pragma: no cover - what this test guards against
        pytest.fail(f"a trace write failure reached the caller: {type(exc).__name__}: {exc}")
    finally:
        session.close()


def test_a_closed_tracer_drops_late_records(tmp_path):
    from membackend._trace import TraceObserver

    tracer = TraceObserver(tmp_path / "t.jsonl")
    tracer.close()
    tracer.event("late", policy="membackend")  # a layer logging after the session closed: no raise
    tracer.close()  # closing twice is harmless
    assert [json.loads(x)["event"] for x in (tmp_path / "t.jsonl").read_text().splitlines()] == ["trace"]


def test_a_trace_setting_naming_a_fifo_nobody_reads_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "membackend._cli", "budget"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60, cwd=tmp_path,
                          env={**os.environ, "MEMBACKEND_TRACE": str(fifo)})
    assert proc.returncode == 2 and "a FIFO (named pipe) nobody reads" in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr
