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

A trace never fails the memory operations it records (G6). A file that cannot be opened, or
whose header cannot be written (a full disk, ``/dev/full``, a FIFO nobody reads), is an
``OSError`` from :class:`TraceObserver` itself, before any verb runs: the session manager turns it
into a ``ConfigError`` for the ``trace`` setting. A write that fails later (the disk fills up
mid-run) stops the trace: one warning is logged, :attr:`TraceObserver.failed` keeps the error,
nothing more is written and every verb goes on as if no tracer were there.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import IO, Any

from .hookspec import hookimpl
from .types import Budget, Fault, Reservation

__all__ = ["TraceObserver", "TRACE_FORMAT", "TRACE_VERSION", "trace_header"]

log = logging.getLogger("membackend.trace")

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


def _open_for_appending(path: Path) -> IO[str]:
    """``path`` opened for appending text, line-buffered, without ever blocking.

    A regular file, a device (``/dev/null``, ``/dev/full``) or anything else that opens at once is
    opened as it is. A FIFO is opened with ``O_NONBLOCK``: one nobody reads is an ``OSError``
    (``ENXIO``) instead of a wait for a reader that may never come; one with a reader is then
    written to as any file (its writes may block while that reader is slow, as a pipe's do)."""
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except FileNotFoundError:
        fifo = False
    if not fifo or not hasattr(os, "O_NONBLOCK"):
        return path.open("a", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "a", buffering=1)
    except BaseException:
        os.close(fd)
        raise


class TraceObserver:
    """Wraps every verb; thread-safe appends, one line per call, flushed at once.

    Contract: constructing one opens the file and writes its header, or raises ``OSError`` with
    nothing left open. After that nothing it does raises into a verb or a policy: the first
    write that fails (:attr:`failed`) ends the trace with one warning, and later records (and
    records after :meth:`close`) are dropped.
    """

    def __init__(self, path: str | Path, **header: Any):
        """Append to ``path``, starting with a header line (a new run) holding ``header``'s fields.

        Raises ``OSError`` when the file cannot be opened (no permission, a folder, a FIFO nobody
        reads) or its header cannot be written (a full disk): the caller decides what that means
        (a ``ConfigError`` at session creation, a ``TraceWriteError`` for ``replay --record``)."""
        self.path = Path(path)
        #: the write that ended the trace (None while it is written)
        self.failed: OSError | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _open_for_appending(self.path)
        # every opening starts a run: a file several processes appended to replays run by run
        try:
            self._file.write(json.dumps(trace_header(**header), default=str) + "\n")
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        """Close the file, dropping what its buffer still holds (it could not be written)."""
        self._closed = True
        f = self._file
        try:
            f.close()
        except (OSError, ValueError):  # the buffer's line does not fit either: close() still closed it
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def _stopped(self, exc: OSError) -> None:
        """The trace could not be written: warn once (``self._lock`` is held). Subclasses that
        report the failure another way override this."""
        log.warning("membackend: the trace %r could not be written (%s); tracing stopped, the memory operations "
                    "go on. Accepted: a file on a disk with room for it", str(self.path)[:200],
                    exc.strerror or exc)

    def event(self, event: str, **fields: Any) -> None:
        """Append one record (used by the verbs below and by policy layers); never raises for the file:
        a write that fails stops the trace (see the class), a record after :meth:`close` is dropped."""
        if self._closed:
            return
        record = {"time": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            if self._closed:
                return
            try:
                self._file.write(line + "\n")
            except OSError as exc:
                self.failed = exc
                self._discard()
                self._stopped(exc)

    def close(self) -> None:
        """Close the file (again: nothing); a last write that fails is kept in :attr:`failed`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._file.close()
            except OSError as exc:
                self.failed = self.failed or exc
                self._discard()

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
