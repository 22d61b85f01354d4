"""Reading a trace for a replay: the header, and the workload a replay re-executes.

A trace (``MEMBACKEND_TRACE``, or ``membackend replay --record``) is JSON lines: a header
(``"event": "trace"``, ``"format": "membackend-trace"``, ``"version"``), then verb calls (no
``policy`` field), then the residency policy's records (a ``policy`` field). A replay re-executes
the policy's *requests* — :data:`WORKLOAD_EVENTS`, each once per call — and ignores everything
else: verb calls and the policy's decisions (``evict``, ``evict_model``, ``reserve``,
``commit``, ...) are what the replay produces again, and a ``full_unload`` carrying ``via`` is the
consequence of another request (its owner's unload, ``unload_all``, ``unregister``).
``docs/trace-format.md`` lists every event and field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .._trace import TRACE_FORMAT, TRACE_VERSION, trace_header
from ..types import MembackendError

__all__ = ["TraceError", "Trace", "WORKLOAD_EVENTS", "read_trace", "write_trace"]

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


class TraceError(MembackendError, ValueError):
    """A trace that cannot be replayed: the message names the line and what was wrong."""


@dataclass
class Trace:
    """A trace's header (empty for a file written without one) and its workload events, in order."""

    header: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    source: str = "<memory>"
    lines: list[int] = field(default_factory=list)  # each event's line in the file (empty when built in memory)
    runs: int = 1  # runs the file held (one header each)

    def where(self, index: int) -> str:
        """Where event ``index`` came from, for error messages."""
        line = f", line {self.lines[index]}" if index < len(self.lines) else ""
        return f"{self.source}{line} (event {index + 1}, {self.events[index]['event']!r})"

    @property
    def scenario(self) -> str | None:
        return self.header.get("scenario")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check(event: dict[str, Any], where: str) -> None:
    name = event["event"]
    missing = [k for k in WORKLOAD_EVENTS[name] if k not in event]
    if missing:
        raise TraceError(f"{where}: a {name!r} event needs {', '.join(missing)}; "
                         f"accepted fields: {', '.join(WORKLOAD_EVENTS[name])}")
    for key in ("bytes", "offset", "floor"):
        if key in event and (key in WORKLOAD_EVENTS[name] or key == "floor") and not _is_count(event[key]):
            raise TraceError(f"{where}: {key!r} must be a whole number of bytes >= 0, got {event[key]!r}")
    if "seconds" in WORKLOAD_EVENTS[name]:
        s = event["seconds"]
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s < 0:
            raise TraceError(f"{where}: 'seconds' must be a finite number >= 0, got {s!r}")
    for key in ("model", "device"):
        if key in WORKLOAD_EVENTS[name] and (not isinstance(event[key], str) or not event[key]):
            raise TraceError(f"{where}: {key!r} must be a non-empty string, got {event[key]!r}")
    for key in ("models", "devices"):
        if key in WORKLOAD_EVENTS[name]:
            v = event[key]
            if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
                raise TraceError(f"{where}: {key!r} must be a non-empty list of strings, got {v!r}")
    if name == "set_watermark" and event["limit"] is not None and not _is_count(event["limit"]):
        raise TraceError(f"{where}: 'limit' must be a whole number of bytes >= 0 or null, got {event['limit']!r}")
    for key in ("owner", "kind", "workflow"):
        if event.get(key) is not None and not isinstance(event[key], str):
            raise TraceError(f"{where}: {key!r} must be a string or null, got {event[key]!r}")


def parse_lines(lines: Iterable[str], source: str = "<memory>", run: int | None = None) -> Trace:
    """Parse JSON lines into a :class:`Trace`; raises :class:`TraceError` naming the line.

    Every header starts a run (a file appended to by several processes holds several); ``run``
    picks one, counted from 1 (default: the last). Events before any header form a run of their own.
    """
    runs: list[Trace] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}, line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg}); a trace holds one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise TraceError(f"{where}: each line must be a JSON object with an 'event' string")
        if record["event"] == "trace":
            if record.get("format") != TRACE_FORMAT:
                raise TraceError(f"{where}: format {record.get('format')!r} is not {TRACE_FORMAT!r}")
            if record.get("version") != TRACE_VERSION:
                raise TraceError(f"{where}: trace version {record.get('version')!r} is not supported; "
                                 f"accepted: {TRACE_VERSION}")
            runs.append(Trace(header=record, source=source))
            continue
        if "policy" not in record or record["event"] not in WORKLOAD_EVENTS or record.get("via"):
            continue  # a verb call, a decision, or the consequence of another request
        _check(record, where)
        if not runs:
            runs.append(Trace(source=source))
        runs[-1].events.append(record)
        runs[-1].lines.append(n)
    if run is not None and not 1 <= run <= len(runs):
        raise TraceError(f"{source}: run {run} does not exist; the file holds {len(runs)} run(s) (1-{len(runs)})")
    trace = runs[(run or len(runs)) - 1] if runs else Trace(source=source)
    trace.runs = len(runs)
    if not any(e["event"] == "register" for e in trace.events):
        raise TraceError(f"{source}: no 'register' event{' in the run chosen' if len(runs) > 1 else ''}: "
                         "nothing to replay (was the trace written by the residency policy, e.g. ComfyUI "
                         "with membackend and MEMBACKEND_TRACE set?)")
    return trace


def read_trace(path: str | Path, run: int | None = None) -> Trace:
    """Read a trace file (``run`` as for :func:`parse_lines`); a missing or unreadable file is a
    :class:`TraceError` too."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(p)!r}: {exc.strerror or exc}") from None
    return parse_lines(text.splitlines(), str(p), run)


def write_trace(path: str | Path, events: Iterable[dict[str, Any]], **header: Any) -> Path:
    """Write a header with ``header``'s fields and ``events`` (each given a ``policy`` field when
    it has none) as a fresh trace file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        f.write(json.dumps(trace_header(**header), default=str) + "\n")
        for e in events:
            f.write(json.dumps({"policy": "workload", **e}, default=str) + "\n")
    return p
