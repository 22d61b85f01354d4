"""The trace reader takes any file: every bad one is a TraceError naming the file and the line,
and a good one is streamed, never held in memory."""

from __future__ import annotations

import inspect
import json
import os

import pytest

from membackend.lab._replay import traceformat
from membackend.lab._replay.traceformat import (
    MAX_LINE_BYTES,
    TraceError,
    TraceEvents,
    TraceWriteError,
    parse_lines,
    read_trace,
    write_trace,
)
from membackend.types import MembackendError

GiB = 1 << 30
HEADER = {"event": "trace", "format": "membackend-trace", "version": 1, "sim_profile": "h200"}
REGISTER = {"event": "register", "policy": "membackend", "model": "m", "bytes": GiB, "devices": ["cuda:0"]}


def _file(tmp_path, *lines, name="t.jsonl"):
    """A trace file of ``lines`` (dicts as JSON, str and bytes as they are)."""
    raw = [json.dumps(x).encode() if isinstance(x, dict) else x.encode() if isinstance(x, str) else x for x in lines]
    path = tmp_path / name
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def _refused(path, *fragments):
    with pytest.raises(TraceError) as info:
        read_trace(path)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_deep_nesting_is_refused_naming_the_line(tmp_path):
    path = _file(tmp_path, HEADER, "[" * 100_000 + "]" * 100_000)
    _refused(path, f"{path}, line 2", "nested too deeply", "flat JSON object")
    inside = '{"event": "register", "policy": "x", "model": "m", "bytes": 1, "devices": ["cuda:0"], "x": ' \
             + "[" * 100_000 + "]" * 100_000 + "}"
    _refused(_file(tmp_path, HEADER, inside, name="u.jsonl"), "line 2", "nested too deeply")


def test_bytes_that_are_not_utf8_are_refused_naming_the_line_and_column(tmp_path):
    line = b'{"event": "register", "policy": "x", "model": "\xff\xfe", "bytes": 1, "devices": ["cuda:0"]}'
    _refused(_file(tmp_path, HEADER, line), "line 2", "not UTF-8 (byte 0xff at column 48)", "UTF-8 text")


def test_a_5000_digit_integer_is_refused_naming_the_line(tmp_path):
    line = '{"event": "register", "policy": "x", "model": "m", "bytes": ' + "9" * 5000 + ', "devices": ["cuda:0"]}'
    _refused(_file(tmp_path, HEADER, line), "line 2", "more than 4,300 digits", "2**63 - 1")


def test_a_count_past_64_bits_is_refused(tmp_path):
    too_big = dict(REGISTER, bytes=1 << 64)
    _refused(_file(tmp_path, HEADER, too_big), "line 2", "'bytes' must be a whole number of bytes from 0 to 2**63 - 1",
             "got 18446744073709551616")


@pytest.mark.parametrize("value", [["x"], 7, {"name": "x"}, ""])
def test_a_header_scenario_of_the_wrong_type_is_refused(tmp_path, value):
    _refused(_file(tmp_path, dict(HEADER, scenario=value), REGISTER), "line 1", "header 'scenario'",
             "a non-empty string or null")


@pytest.mark.parametrize("value", ["big", ["a"], 24, True])
def test_a_header_machine_of_the_wrong_type_is_refused(tmp_path, value):
    _refused(_file(tmp_path, dict(HEADER, machine=value), REGISTER), "line 1", "header 'machine' must be an object",
             f"got {json.dumps(value)}")


@pytest.mark.parametrize("value", [-1, 0, 1.5, "24GiB", True, None])
def test_device_memory_must_be_a_positive_whole_number(tmp_path, value):
    path = _file(tmp_path, dict(HEADER, machine={"device_memory": value}), REGISTER)
    _refused(path, "line 1", "'device_memory' must be a whole number of bytes from 1 to 2**63 - 1",
             f"got {json.dumps(value)}")


@pytest.mark.parametrize("field, value", [("pagein_seconds", -0.5), ("copy_bandwidth", 0), ("copy_bandwidth", "fast"),
                                          ("wddm", [1])])
def test_the_other_machine_fields_are_checked(tmp_path, field, value):
    _refused(_file(tmp_path, dict(HEADER, machine={field: value}), REGISTER), "line 1", f"field {field!r}")


@pytest.mark.parametrize("value", [True, 1.0, "1", None, 2])
def test_the_version_must_be_the_number_1(tmp_path, value):
    header = dict(HEADER, version=value) if value is not None else {k: v for k, v in HEADER.items() if k != "version"}
    _refused(_file(tmp_path, header, REGISTER), "line 1", f"trace version {json.dumps(value)} is not supported",
             "accepted: 1")


@pytest.mark.parametrize("field", ["backend", "sim_profile"])
def test_header_names_must_be_strings(tmp_path, field):
    _refused(_file(tmp_path, dict(HEADER, **{field: 5}), REGISTER), "line 1", f"header {field!r}", "got 5")


def test_a_missing_file_says_no_such_file(tmp_path):
    _refused(tmp_path / "nosuch.jsonl", "nosuch.jsonl: no such file", "accepted: the path of a trace file")


def test_a_folder_is_refused(tmp_path):
    _refused(tmp_path, "a folder, not a file")


def test_a_line_longer_than_the_limit_is_refused_without_reading_it_all(tmp_path):
    path = _file(tmp_path, HEADER, REGISTER, b" " * (4 * MAX_LINE_BYTES) + b"{}")
    _refused(path, "line 3", f"longer than {MAX_LINE_BYTES:,} bytes")


@pytest.mark.parametrize("text, fragment", [
    ("{oops", "not JSON (Expecting property name"),
    ("[1, 2]", 'an "event" string, got [1, 2]'),
    ('{"event": 5}', 'an "event" string'),
    ("NaN", 'an "event" string, got NaN'),
])
def test_lines_that_are_no_record_name_their_line(tmp_path, text, fragment):
    _refused(_file(tmp_path, HEADER, REGISTER, text), "line 3", fragment)


def test_every_error_is_a_membackend_error_and_a_value_error():
    assert issubclass(TraceError, MembackendError) and issubclass(TraceError, ValueError)
    assert issubclass(TraceWriteError, MembackendError) and issubclass(TraceWriteError, OSError)


def test_parse_lines_takes_bytes_too():
    lines = [json.dumps(HEADER).encode(), json.dumps(REGISTER).encode(), b"\xc3\x28"]
    with pytest.raises(TraceError, match=r"<memory>, line 3: not UTF-8 \(byte 0xc3 at column 1\)"):
        parse_lines(lines)


# --------------------------------------------------------------------------- streaming


def test_the_events_of_a_file_are_streamed_not_held(tmp_path):
    events = [REGISTER] + [{"event": "fault", "policy": "membackend", "model": "m", "device": "cuda:0", "offset": 0,
                            "bytes": GiB}] * 50 + [{"event": "unload_all", "policy": "membackend"}]
    path = _file(tmp_path, {"event": "trace", "format": "membackend-trace", "version": 1}, REGISTER,
                 HEADER, *events)
    trace = read_trace(path)
    assert isinstance(trace.events, TraceEvents) and not isinstance(trace.events, list)
    assert len(trace.events) == 52 and trace.runs == 2 and trace.header_line == 3
    assert trace.tail == ("fault", "unload_all")
    it = trace.numbered()
    assert inspect.isgenerator(it)  # one event at a time, read from the file as it is asked for
    first = next(it)
    assert first == (4, REGISTER)
    assert [line for line, _ in trace.numbered()] == list(range(4, 56))
    assert [e["event"] for e in trace.events][-1] == "unload_all"  # iterable again, from the file
    assert read_trace(path, run=1).events.count == 1


def test_the_reader_keeps_no_list_of_a_files_events(tmp_path, monkeypatch):
    """Scanning a file keeps counts and the last two names, not the events (the memory figure of a long
    trace is measured side by side in the report; here: no event is collected)."""
    kept = []
    original = traceformat._Run.add

    def add(self, n, record):
        original(self, n, record)
        kept.append(self.events)
    monkeypatch.setattr(traceformat._Run, "add", add)
    read_trace(_file(tmp_path, HEADER, REGISTER, REGISTER))
    assert kept == [None, None]


def test_a_file_that_changes_after_it_was_read_is_refused(tmp_path):
    path = _file(tmp_path, HEADER, REGISTER)
    trace = read_trace(path)
    with path.open("a") as f:
        f.write(json.dumps(REGISTER) + "\n")
    with pytest.raises(TraceError, match="changed since it was read"):
        list(trace.events)


def test_write_trace_names_the_file_it_cannot_write(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(TraceWriteError, match=r"cannot write the trace '.*w\.jsonl': No space left on device") as info:
        write_trace(tmp_path / "w.jsonl", [REGISTER])
    assert info.value.errno == errno.ENOSPC
