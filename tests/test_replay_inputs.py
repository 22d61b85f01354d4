"""``membackend replay`` on anything that is not a regular trace file (a FIFO, a socket, a device,
standard input) exits 2 with one line naming what was given and what is accepted, and never
hangs: opening a FIFO for reading (or writing, for ``--record``) blocks until the other end
appears, so every case runs the CLI in a subprocess with a timeout -- a hang fails the test
instead of hanging the run. ``--plot ""`` is refused the same way."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

#: a replay that refuses its input returns at once: this only turns a hang into a failure
TIMEOUT_S = 30

GiB = 1 << 30
HEADER = '{"event": "trace", "format": "membackend-trace", "version": 1, "sim_profile": "h200"}'
REGISTER = ('{"event": "register", "policy": "membackend", "model": "m", "bytes": %d, "devices": ["cuda:0"]}'
            % GiB)

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


def _cli(*args: str, cwd, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """``membackend ARGS`` in a subprocess; a hang fails the test (TimeoutExpired) rather than blocking."""
    try:
        return subprocess.run([sys.executable, "-m", "membackend._cli", *args], cwd=cwd, stdin=stdin,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"membackend {' '.join(args)} hung (no answer in {TIMEOUT_S} s)")


def _refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, one line on stderr holding every fragment, no traceback, nothing on stdout."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "\n" not in err, proc.stderr
    assert err.startswith("membackend: ") and "accepted: " in err, err
    for fragment in fragments:
        assert fragment in err, err
    assert proc.stdout == ""
    return err


@needs_fifo
def test_a_fifo_nobody_writes_to_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)
    err = _refused(_cli("replay", str(fifo), cwd=tmp_path), str(fifo), "a FIFO", "regular trace file")
    assert "line" not in err.split("accepted:")[0]  # nothing was read from it


@needs_fifo
def test_a_link_to_a_fifo_is_refused_too(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "run.jsonl"
    link.symlink_to(fifo)
    _refused(_cli("replay", str(link), cwd=tmp_path), str(link), "a FIFO", "regular trace file")


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="no AF_UNIX sockets on this platform")
def test_a_unix_socket_file_is_refused(tmp_path):
    here = os.getcwd()
    os.chdir(tmp_path)  # a relative name: AF_UNIX paths are short (108 bytes) and tmp_path may not be
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("run.sock")
        s.listen(1)
    finally:
        os.chdir(here)
    try:
        _refused(_cli("replay", "./run.sock", cwd=tmp_path), "./run.sock", "a socket", "regular trace file")
    finally:
        s.close()


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_dev_zero_is_refused_as_a_device(tmp_path):
    _refused(_cli("replay", "/dev/zero", cwd=tmp_path), "/dev/zero", "a character device", "regular trace file")


@pytest.mark.skipif(not os.path.exists("/dev/stdin"), reason="no /dev/stdin here")
def test_dev_stdin_is_refused_whatever_it_is(tmp_path):
    """Standard input a pipe that stays open (it would block a read) and the null device: both refused."""
    r, w = os.pipe()
    try:
        _refused(_cli("replay", "/dev/stdin", cwd=tmp_path, stdin=r), "/dev/stdin", "a FIFO", "regular trace file")
    finally:
        os.close(r)
        os.close(w)
    _refused(_cli("replay", "/dev/stdin", cwd=tmp_path), "/dev/stdin", "a character device")


@needs_fifo
def test_a_long_path_is_cut_short_in_the_message(tmp_path):
    folder = tmp_path
    for i in range(4):
        folder = folder / (f"{i}" * 100)
    folder.mkdir(parents=True)
    fifo = folder / "run.jsonl"
    os.mkfifo(fifo)
    err = _refused(_cli("replay", str(fifo), cwd=tmp_path), "run.jsonl", "a FIFO")
    assert len(str(fifo)) > 400 and len(err) < len(str(fifo))  # at most ~200 characters of the path


@needs_fifo
def test_a_trace_swapped_for_a_fifo_between_readings_is_refused_without_blocking(tmp_path):
    """The file is read twice (checked, then streamed): a FIFO put in its place is refused, never waited on."""
    trace = tmp_path / "run.jsonl"
    trace.write_text(f"{HEADER}\n{REGISTER}\n")
    script = textwrap.dedent(f"""
        import os
        from membackend.lab._replay.traceformat import TraceError, read_trace
        t = read_trace({str(trace)!r})
        os.unlink({str(trace)!r})
        os.mkfifo({str(trace)!r})
        try:
            list(t.events)
        except TraceError as exc:
            print("refused:", exc)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("streaming a trace swapped for a FIFO hung")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused: ") and str(trace) in proc.stdout, proc.stdout


@needs_fifo
def test_record_into_a_fifo_nobody_reads_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "rec.jsonl"
    os.mkfifo(fifo)
    _refused(_cli("replay", "hook-unload", "--policy", "plugin", "--record", str(fifo), cwd=tmp_path),
             f"cannot write the trace {str(fifo)!r}")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # left as it was


def test_a_regular_trace_file_still_reads(tmp_path):
    from membackend.lab._replay.traceformat import read_trace

    trace = tmp_path / "run.jsonl"
    trace.write_text(f"{HEADER}\n{REGISTER}\n")
    t = read_trace(trace)
    assert [e["event"] for e in t.events] == ["register"]


def test_plot_with_an_empty_path_is_refused_before_the_replay_runs(tmp_path):
    err = _refused(_cli("replay", "hook-unload", "--plot", "", cwd=tmp_path), "--plot", "empty")
    for suffix in (".png", ".svg", ".pdf", ".html"):
        assert suffix in err.split("accepted:", 1)[1], err
    assert list(tmp_path.iterdir()) == []  # nothing written
