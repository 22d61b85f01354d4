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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..trace import TRACE_FORMAT, TRACE_VERSION, trace_header
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
}


class TraceError(MembackendError, ValueError):
    """A trace that cannot be replayed: the message names the line and what was wrong."""


@dataclass
class Trace:
    """A trace's header (empty for a file written without one) and its workload events, in order."""

    header: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    source: str = "<memory>"

    @property
    def scenario(self) -> str | None:
        return self.header.get("scenario")


def _check(event: dict[str, Any], where: str) -> None:
    missing = [k for k in WORKLOAD_EVENTS[event["event"]] if k not in event]
    if missing:
        raise TraceError(f"{where}: a {event['event']!r} event needs {', '.join(missing)}; "
                         f"accepted fields: {', '.join(WORKLOAD_EVENTS[event['event']])}")
    for key in ("bytes", "offset"):
        if key in event and key in WORKLOAD_EVENTS[event["event"]] and (
                not isinstance(event[key], int) or isinstance(event[key], bool) or event[key] < 0):
            raise TraceError(f"{where}: {key!r} must be a whole number of bytes >= 0, got {event[key]!r}")
    if "seconds" in WORKLOAD_EVENTS[event["event"]]:
        s = event["seconds"]
        if not isinstance(s, (int, float)) or isinstance(s, bool) or s < 0:
            raise TraceError(f"{where}: 'seconds' must be a number >= 0, got {s!r}")


def parse_lines(lines: Iterable[str], source: str = "<memory>") -> Trace:
    """Parse JSON lines into a :class:`Trace`; raises :class:`TraceError` naming the line."""
    trace = Trace(source=source)
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
            if n_events := len(trace.events):
                raise TraceError(f"{where}: a second header after {n_events} events; one trace per file")
            trace.header = record
            continue
        if "policy" not in record or record["event"] not in WORKLOAD_EVENTS or record.get("via"):
            continue  # a verb call, a decision, or the consequence of another request
        _check(record, where)
        trace.events.append(record)
    if not any(e["event"] == "register" for e in trace.events):
        raise TraceError(f"{source}: no 'register' event: nothing to replay (was the trace written by "
                         "the residency policy, e.g. ComfyUI with membackend and MEMBACKEND_TRACE set?)")
    return trace


def read_trace(path: str | Path) -> Trace:
    """Read a trace file; a missing or unreadable file is a :class:`TraceError` too."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(p)!r}: {exc.strerror or exc}") from None
    return parse_lines(text.splitlines(), str(p))


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
