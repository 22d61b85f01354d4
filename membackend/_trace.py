"""The tracer: an observer that appends one JSON line per verb call to a file.

Each line holds ``time`` (seconds since the epoch), ``event`` (the verb),
``device``, ``reservation`` (its id), ``offset``/``bytes`` where the verb has
them, ``result`` (``ok``, ``oom``, the bytes dropped, or the error's type) and
``seconds`` spent. Later layers (the residency policy) append their decisions
to the same file through :meth:`TraceObserver.event`, so one run can be
replayed from its trace.

Each opening writes one header line, ``{"event": "trace", "format":
"membackend-trace", "version": 1, "membackend": <version>, ...}``, which starts
a run (a file appended to by several processes holds several runs); the format
(which events a replay re-executes, and their fields) is documented in
``docs/trace-format.md``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from .hookspec import hookimpl
from .types import Budget, Fault, Reservation

__all__ = ["TraceObserver", "TRACE_FORMAT", "TRACE_VERSION", "trace_header"]

TRACE_FORMAT = "membackend-trace"
#: bumped when a field a replay relies on changes meaning; readers refuse versions they do not know
TRACE_VERSION = 1


def trace_header(**fields: Any) -> dict[str, Any]:
    """The first line of a trace file: the format, its version, the writer's version, and ``fields``
    (e.g. ``sim_profile``, ``scenario``, ``machine``)."""
    from ._version import __version__

    return {"time": round(time.time(), 6), "event": "trace", "format": TRACE_FORMAT, "version": TRACE_VERSION,
            "membackend": __version__, **fields}


def _describe(result: Any) -> Any:
    if isinstance(result, Fault):
        return "ok" if result.ok else "oom"
    if isinstance(result, Reservation):
        return {"reservation": result.id, "base": result.base, "size": result.size}
    if isinstance(result, Budget):
        return {"total": result.total, "free": result.free, "usable": result.usable, "source": result.source}
    return result


class TraceObserver:
    """Wraps every verb; thread-safe appends, one line per call, flushed at once."""

    def __init__(self, path: str | Path, **header: Any):
        """Append to ``path``, starting with a header line (a new run) holding ``header``'s fields."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._lock = threading.Lock()
        # every opening starts a run: a file several processes appended to replays run by run
        self._file.write(json.dumps(trace_header(**header), default=str) + "\n")

    def event(self, event: str, **fields: Any) -> None:
        """Append one record (used by the verbs below and by policy layers)."""
        record = {"time": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()

    def _around(self, event: str, fields: dict[str, Any]):
        start = time.perf_counter()
        try:
            result = yield
        except BaseException as exc:
            self.event(event, **fields, result=type(exc).__name__, seconds=round(time.perf_counter() - start, 9))
            raise
        self.event(event, **fields, result=_describe(result), seconds=round(time.perf_counter() - start, 9))
        return result

    @staticmethod
    def _res(r: Reservation | None) -> dict[str, Any]:
        return {"reservation": r.id, "device": str(r.device)} if r is not None else {}

    @hookimpl(wrapper=True)
    def membackend_reserve(self, device, size):
        return (yield from self._around("reserve", {"device": str(device), "bytes": size}))

    @hookimpl(wrapper=True)
    def membackend_fault(self, reservation, offset, size):
        return (yield from self._around("fault", {**self._res(reservation), "offset": offset, "bytes": size}))

    @hookimpl(wrapper=True)
    def membackend_free(self, reservation, offset, size):
        return (yield from self._around("free", {**self._res(reservation), "offset": offset, "bytes": size}))

    @hookimpl(wrapper=True)
    def membackend_release_reservation(self, reservation):
        return (yield from self._around("release_reservation", {**self._res(reservation), "bytes": reservation.size}))

    @hookimpl(wrapper=True)
    def membackend_fence(self, device, reservation):
        return (yield from self._around("fence", {"device": str(device), **self._res(reservation)}))

    @hookimpl(wrapper=True)
    def membackend_budget_query(self, device):
        return (yield from self._around("budget_query", {"device": str(device)}))
