"""Reading a trace for a replay: the header, and the workload a replay re-executes.

A trace (``MEMBACKEND_TRACE``, or ``membackend replay --record``) is JSON lines: a header
(``"event": "trace"``, ``"format": "membackend-trace"``, ``"version"``), then verb calls (no
``policy`` field), then the residency policy's records (a ``policy`` field). A replay re-executes
the policy's *requests* — :data:`WORKLOAD_EVENTS`, each once per call — and ignores everything
else: verb calls and the policy's decisions (``evict``, ``evict_model``, ``reserve``,
``commit``, ...) are what the replay produces again, and a ``full_unload`` carrying ``via`` is the
consequence of another request (its owner's unload, ``unload_all``, ``unregister``).
``docs/trace-format.md`` lists every event and field.

Any file is accepted as input: whatever it holds, :func:`read_trace` either returns a
:class:`Trace` or raises :class:`TraceError` naming the file and the line and saying what is
accepted (never another exception). A file is read twice and never held in memory: once to check
every line and find the run to replay, then once per replayed side, streamed
(:class:`TraceEvents`), so memory does not grow with the trace's length.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..._settings.rules import os_reason, shown
from ..._trace import TRACE_FORMAT, TRACE_VERSION, trace_header
from ...types import _TraceError as TraceError
from ...types import _TraceWriteError as TraceWriteError

__all__ = ["TraceError", "TraceWriteError", "Trace", "TraceEvents", "WORKLOAD_EVENTS", "MAX_LINE_BYTES",
           "MAX_COUNT", "MAX_SHOWN", "HEADER_MACHINE_FIELDS", "parse_lines", "read_trace", "write_trace",
           "shown_path", "file_kind", "open_regular"]

#: the longest line a reader takes (a trace line is one small JSON object; longer is not a trace)
MAX_LINE_BYTES = 1 << 20
#: the largest size or offset accepted: what the drivers' 64-bit signed size arguments hold
MAX_COUNT = (1 << 63) - 1
#: the most characters of a path (or any user input) an error message quotes
MAX_SHOWN = 200

#: what ``membackend replay`` takes as a trace file (the end of every refusal of one)
ACCEPTED_FILE = "a regular trace file (written with MEMBACKEND_TRACE or membackend replay --record)"

#: the requests a replay re-executes, with the fields each needs
WORKLOAD_EVENTS: dict[str, tuple[str, ...]] = {
    "register": ("model", "bytes", "devices"),
    "use": ("models",),
    "fault": ("model", "device", "offset", "bytes"),
    "copy": ("model", "device", "offset", "bytes", "seconds"),
    "compute": ("seconds",),
    "unpin": ("model", "device", "offset", "bytes"),
    "full_unload": ("model",),
    "unload_all": (),
    "unregister": ("model",),
    "free_memory": ("device", "bytes"),
    "shed": ("model", "device", "bytes"),
    "idle": (),
    "prioritize": ("model",),
    "deprioritize": ("model",),
    "set_watermark": ("model", "device", "limit"),
}

#: the header's ``machine`` fields replays write, with what each accepts (any other key is checked
#: against the profile it is applied to, see ``membackend.lab._replay.compare``)
HEADER_MACHINE_FIELDS = {
    "device_memory": "a whole number of bytes from 1 to 2**63 - 1",
    "pagein_seconds": "a finite number of seconds >= 0",
    "copy_bandwidth": "a finite number of bytes per second > 0",
}

#: header fields that hold a name (or null)
_HEADER_NAMES = ("scenario", "sim_profile", "backend", "membackend")


def shown_path(path: str | os.PathLike[str], limit: int = MAX_SHOWN) -> str:
    """``path`` as an error message shows it (:func:`membackend._settings.rules.shown`, what every refusal
    that names a path or a name uses): as it is up to ``limit`` characters, else its start and its end (the
    file's name) around ``...`` with its length; an empty path, or one with a newline or another character
    that does not print, quoted as Python writes it -- so a message stays one readable line."""
    return shown(path, limit)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` that is not a regular file is, in words ("a FIFO (named pipe)", ...)."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def _not_regular(source: str, mode: int) -> TraceError:
    kind = file_kind(mode)
    if kind == "a folder":
        return TraceError(f"{source}: a folder, not a file; accepted: {ACCEPTED_FILE}")
    return TraceError(f"{source}: {kind}, not a regular file; accepted: {ACCEPTED_FILE}")


def open_regular(path: Path, source: str) -> Any:
    """Open ``path`` for reading (binary) if it is a regular file, else raise :class:`TraceError`
    naming ``source``, what the path is (a FIFO, a socket, a device, a folder) and what is accepted.

    Never blocks: the path is looked at (``os.stat``, following links) before it is opened, and it
    is opened with ``O_NONBLOCK`` (a FIFO swapped in meanwhile opens at once and is refused by its
    ``fstat``), so no FIFO, terminal or device is ever waited on. Raises ``FileNotFoundError`` for
    a path that is not there and ``OSError`` for one that cannot be read; the caller words those."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(source, st.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the look and the opening
            raise _not_regular(source, st.st_mode)
        if flags & getattr(os, "O_NONBLOCK", 0):  # no effect on a regular file; cleared all the same
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _show(value: Any, limit: int = 60) -> str:
    """A value as the trace wrote it (JSON), cut short: error messages stay one readable line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_COUNT


def _is_seconds(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _check(event: dict[str, Any], where: str) -> None:
    """A workload event's fields, or :class:`TraceError` naming the field and what it accepts."""
    name = event["event"]
    missing = [k for k in WORKLOAD_EVENTS[name] if k not in event]
    if missing:
        raise TraceError(f"{where}: a {name!r} event needs {', '.join(missing)}; "
                         f"accepted fields: {', '.join(WORKLOAD_EVENTS[name])}")
    for key in ("bytes", "offset", "floor"):
        if key in event and (key in WORKLOAD_EVENTS[name] or key == "floor") and not _is_count(event[key]):
            raise TraceError(f"{where}: {key!r} must be a whole number of bytes from 0 to 2**63 - 1, "
                             f"got {_show(event[key])}")
    if "seconds" in WORKLOAD_EVENTS[name] and not _is_seconds(event["seconds"]):
        raise TraceError(f"{where}: 'seconds' must be a finite number >= 0, got {_show(event['seconds'])}")
    for key in ("model", "device"):
        if key in WORKLOAD_EVENTS[name] and (not isinstance(event[key], str) or not event[key]):
            raise TraceError(f"{where}: {key!r} must be a non-empty string, got {_show(event[key])}")
    for key in ("models", "devices"):
        if key in WORKLOAD_EVENTS[name]:
            v = event[key]
            if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
                raise TraceError(f"{where}: {key!r} must be a non-empty list of strings, got {_show(v)}")
    if name == "set_watermark" and event["limit"] is not None and not _is_count(event["limit"]):
        raise TraceError(f"{where}: 'limit' must be a whole number of bytes from 0 to 2**63 - 1 or null, "
                         f"got {_show(event['limit'])}")
    for key in ("owner", "kind", "workflow"):
        if event.get(key) is not None and not isinstance(event[key], str):
            raise TraceError(f"{where}: {key!r} must be a string or null, got {_show(event[key])}")


def _check_header(header: dict[str, Any], where: str) -> None:
    """A header's fields, or :class:`TraceError` naming the field and what it accepts."""
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(f"{where}: format {_show(header.get('format'))} is not {TRACE_FORMAT!r}; "
                         f"accepted: a header with \"format\": \"{TRACE_FORMAT}\"")
    version = header.get("version")
    if type(version) is not int or version != TRACE_VERSION:  # true == 1 in Python, not in a trace
        raise TraceError(f"{where}: trace version {_show(version)} is not supported; accepted: {TRACE_VERSION}")
    for key in _HEADER_NAMES:
        if header.get(key) is not None and not (isinstance(header[key], str) and header[key]):
            raise TraceError(f"{where}: header {key!r} must be a non-empty string or null, got {_show(header[key])}")
    devices = header.get("devices")
    if devices is not None and not (isinstance(devices, list) and all(isinstance(d, dict) for d in devices)):
        raise TraceError(f"{where}: header 'devices' must be a list of objects or null, got {_show(devices)}")
    machine = header.get("machine")
    if machine is None:
        return
    if not isinstance(machine, dict):
        raise TraceError(f"{where}: header 'machine' must be an object of profile fields (e.g. "
                         f"{{\"device_memory\": 25769803776}}) or null, got {_show(machine)}")
    for key, value in machine.items():
        accepted = HEADER_MACHINE_FIELDS.get(key)
        ok = (_is_count(value) and value >= 1 if key == "device_memory" else
              _is_seconds(value) if key == "pagein_seconds" else
              _is_seconds(value) and value > 0 if key == "copy_bandwidth" else
              value is None or type(value) in (bool, int, float, str))
        if not ok:
            raise TraceError(f"{where}: header 'machine' field {key!r} must be "
                             f"{accepted or 'a number, a string, true/false or null'}, got {_show(value)}")


def _decode(raw: bytes | str, where: str) -> str:
    if isinstance(raw, str):
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{where}: longer than {MAX_LINE_BYTES:,} bytes; a trace line is one small JSON object")
        return raw
    if len(raw) > MAX_LINE_BYTES:
        raise TraceError(f"{where}: longer than {MAX_LINE_BYTES:,} bytes; a trace line is one small JSON object")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                         "a trace is UTF-8 text, one JSON object per line") from None


def _parse_line(raw: bytes | str, where: str) -> dict[str, Any] | None:
    """One line as a record (None: a blank line), or :class:`TraceError` saying why it is none."""
    text = _decode(raw, where)
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); "
                         "a trace holds one JSON object per line") from None
    except RecursionError:
        raise TraceError(f"{where}: nested too deeply to read; a trace line is a flat JSON object "
                         "(its values: numbers, strings, lists of strings)") from None
    except ValueError:  # an integer literal longer than Python converts (sys.get_int_max_str_digits)
        raise TraceError(f"{where}: a number with more than {sys.get_int_max_str_digits():,} digits; "
                         "accepted: sizes and offsets as whole numbers from 0 to 2**63 - 1, seconds as "
                         "finite numbers") from None
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        raise TraceError(f"{where}: each line must be a JSON object with an \"event\" string, got "
                         f"{_show(record)}")
    return record


def _is_workload(record: dict[str, Any]) -> bool:
    return "policy" in record and record["event"] in WORKLOAD_EVENTS and not record.get("via")


class _Run:
    """One run found while reading: its header, where it lies in the file, and what a replay
    needs to know of its events without keeping them (unless ``collect``)."""

    def __init__(self, header: dict[str, Any], header_line: int | None, start: int, first_line: int,
                 collect: bool):
        self.header, self.header_line = header, header_line
        self.start, self.first_line, self.last_line = start, first_line, first_line - 1
        self.count, self.registers = 0, False
        self.tail: deque[str] = deque(maxlen=2)
        self.events: list[dict[str, Any]] | None = [] if collect else None
        self.lines: list[int] | None = [] if collect else None

    def add(self, n: int, record: dict[str, Any]) -> None:
        self.count += 1
        self.registers = self.registers or record["event"] == "register"
        self.tail.append(record["event"])
        if self.events is not None:
            self.events.append(record)
            self.lines.append(n)  # type: ignore[union-attr]


def _scan(lines: Iterable[tuple[int, int, bytes | str]], source: str, run: int | None,
          collect: bool) -> tuple[_Run | None, int]:
    """Check every line of ``(line number, byte offset after it, text)``; return the run ``run``
    picks (None: the last) and how many runs there are."""
    runs, chosen, current = 0, None, None
    for n, end, raw in lines:
        where = f"{source}, line {n}"
        record = _parse_line(raw, where)
        if record is None:
            if current is not None:
                current.last_line = n
            continue
        if record["event"] == "trace":
            _check_header(record, where)
            runs += 1
            current = _Run(record, n, end, n + 1, collect)
            if run is None or runs == run:
                chosen = current
            continue
        if current is None:  # events before any header form a run of their own, from the file's start
            runs += 1
            current = _Run({}, None, 0, 1, collect)
            if run is None or runs == run:
                chosen = current
        current.last_line = n
        if _is_workload(record):
            _check(record, where)
            current.add(n, record)
    return chosen, runs


class TraceEvents:
    """A file's workload events of one run, read from the file each time they are iterated (one
    line at a time), so a replay of any length holds one event at a time.

    ``len()`` is the number of events. A file that changed since it was first read is a
    :class:`TraceError` (replay it again), as is any line that no longer reads."""

    def __init__(self, path: Path, source: str, start: int, first_line: int, last_line: int, count: int,
                 signature: tuple[int, int]):
        self.path, self.source = path, source
        self.start, self.first_line, self.last_line = start, first_line, last_line
        self.count, self.signature = count, signature

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (event for _, event in self.numbered())

    def numbered(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(line number, event)`` for each workload event, in order."""
        changed = TraceError(f"{self.source}: the file changed since it was read; run the replay again")
        try:
            f = open_regular(self.path, self.source)
        except TraceError:  # a FIFO, a device or a folder in its place
            raise changed from None
        except OSError as exc:
            raise TraceError(f"{self.source}: cannot read it again: {exc.strerror or exc}") from None
        with f:
            st = os.fstat(f.fileno())
            if (st.st_size, st.st_mtime_ns) != self.signature:
                raise changed
            f.seek(self.start)
            n = self.first_line - 1
            while n < self.last_line:
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    raise changed
                n += 1
                record = _parse_line(raw, f"{self.source}, line {n}")
                if record is None or not _is_workload(record):
                    if record is not None and record["event"] == "trace":
                        raise changed
                    continue
                _check(record, f"{self.source}, line {n}")
                yield n, record


@dataclass
class Trace:
    """A trace's header (empty for a file written without one) and its workload events, in order.

    ``events`` is a list for a trace built in memory (a scenario, :func:`parse_lines`) and a
    :class:`TraceEvents` (streamed from the file) for one :func:`read_trace` read; iterate it,
    or :meth:`numbered` for each event's line too."""

    header: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] | TraceEvents = field(default_factory=list)
    source: str = "<memory>"
    lines: list[int] = field(default_factory=list)  # in memory: each event's line (empty when built)
    runs: int = 1  # runs the file held (one header each)
    header_line: int | None = None  # the header's line in the file (None: built in memory, or no header)
    last_events: tuple[str, ...] | None = None  # the last two events' names (None: read from ``events``)

    def numbered(self) -> Iterator[tuple[int | None, dict[str, Any]]]:
        """``(line or None, event)`` for every workload event, in order (streamed from a file)."""
        if isinstance(self.events, TraceEvents):
            return self.events.numbered()
        return ((self.lines[i] if i < len(self.lines) else None, e) for i, e in enumerate(self.events))

    @property
    def tail(self) -> tuple[str, ...]:
        """The names of the last two events (what a replay checks the run ended with)."""
        if self.last_events is not None:
            return self.last_events
        return tuple(e["event"] for e in self.events[-2:]) if isinstance(self.events, list) else ()

    def where(self, index: int, line: int | None = None, event: dict[str, Any] | None = None) -> str:
        """Where event ``index`` (counted from 0) came from, for error messages: the file, its
        ``line`` (looked up for a trace parsed in memory) and the event's name."""
        if line is None and index < len(self.lines):
            line = self.lines[index]
        if event is None and isinstance(self.events, list) and index < len(self.events):
            event = self.events[index]
        at = f", line {line}" if line is not None else ""
        name = f", {event['event']!r}" if event is not None else ""
        return f"{self.source}{at} (event {index + 1}{name})"

    def header_where(self) -> str:
        """The header's place, for errors about its fields."""
        return f"{self.source}, line {self.header_line} (the header)" if self.header_line else self.source

    @property
    def scenario(self) -> str | None:
        return self.header.get("scenario")


def _finish(chosen: _Run | None, runs: int, source: str, run: int | None) -> None:
    if run is not None and not 1 <= run <= runs:
        raise TraceError(f"{source}: run {run} does not exist; the file holds {runs} run(s)"
                         f"{f' (1-{runs})' if runs else ''}")
    if chosen is None or not chosen.registers:
        raise TraceError(f"{source}: no 'register' event{' in the run chosen' if runs > 1 else ''}: "
                         "nothing to replay; accepted: a trace written by the residency policy (ComfyUI "
                         "with membackend and MEMBACKEND_TRACE set, or membackend replay --record)")


def parse_lines(lines: Iterable[str | bytes], source: str = "<memory>", run: int | None = None) -> Trace:
    """Parse JSON lines held in memory into a :class:`Trace` (its events a list); raises
    :class:`TraceError` naming the line.

    Every header starts a run (a file appended to by several processes holds several); ``run``
    picks one, counted from 1 (default: the last). Events before any header form a run of their own.
    """
    chosen, runs = _scan(((n, 0, raw) for n, raw in enumerate(lines, 1)), source, run, collect=True)
    _finish(chosen, runs, source, run)
    assert chosen is not None and chosen.events is not None and chosen.lines is not None
    return Trace(header=chosen.header, events=chosen.events, source=source, lines=chosen.lines, runs=runs,
                 header_line=chosen.header_line)


def _file_lines(f: Any) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset after the line, bytes)`` of a binary file, at most
    ``MAX_LINE_BYTES + 1`` bytes a line (so one endless line costs no more)."""
    n, offset = 0, 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        n += 1
        offset += len(raw)
        yield n, offset, raw


def _unreadable(source: str, exc: OSError) -> TraceError:
    return TraceError(f"{source}: cannot read it: {os_reason(exc)}; accepted: a readable trace file")


def read_trace(path: str | Path, run: int | None = None) -> Trace:
    """Read a trace file (``run`` as for :func:`parse_lines`): every line is checked now, the
    events are streamed from the file when a replay iterates them. A missing, unreadable or
    malformed file is a :class:`TraceError` naming it (and the line).

    Only a regular file (or a link to one) is read: a FIFO, a socket, a device (``/dev/zero``,
    ``/dev/stdin``) or a folder is a :class:`TraceError` saying what it is, and is never opened in
    a way that could block (see :func:`open_regular`). Messages show at most :data:`MAX_SHOWN`
    characters of the path."""
    p = Path(path)
    source = shown_path(path)  # as given: "./run.sock" stays "./run.sock"
    try:
        f = open_regular(p, source)
    except TraceError:  # a FIFO, a socket, a device, a folder: said by open_regular
        raise
    except FileNotFoundError:
        raise TraceError(f"{source}: no such file; accepted: the path of a trace file (written with "
                         "MEMBACKEND_TRACE or membackend replay --record)") from None
    except IsADirectoryError:
        raise TraceError(f"{source}: a folder, not a file; accepted: the path of a trace file") from None
    except OSError as exc:
        raise _unreadable(source, exc) from None
    except ValueError:  # a NUL byte in the path
        raise TraceError(f"{source} is not a path (it holds a NUL byte); accepted: {ACCEPTED_FILE}") from None
    with f:
        try:
            st = os.fstat(f.fileno())
            chosen, runs = _scan(_file_lines(f), source, run, collect=False)
        except OSError as exc:  # an I/O error halfway (a disk, a network share)
            raise _unreadable(source, exc) from None
    _finish(chosen, runs, source, run)
    assert chosen is not None
    events = TraceEvents(p, source, chosen.start, chosen.first_line, chosen.last_line, chosen.count,
                         (st.st_size, st.st_mtime_ns))
    return Trace(header=chosen.header, events=events, source=source, runs=runs, header_line=chosen.header_line,
                 last_events=tuple(chosen.tail))


def write_trace(path: str | Path, events: Iterable[dict[str, Any]], **header: Any) -> Path:
    """Write a header with ``header``'s fields and ``events`` (each given a ``policy`` field when
    it has none) as a fresh trace file; a write that fails is a :class:`TraceWriteError`."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("w") as f:
            f.write(json.dumps(trace_header(**header), default=str) + "\n")
            for e in events:
                f.write(json.dumps({"policy": "workload", **e}, default=str) + "\n")
    except OSError as exc:
        raise TraceWriteError(p, exc, shown_path(p)) from None
    return p
