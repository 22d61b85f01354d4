"""A :class:`Session`: one selected backend, its ledger and its observers.

The session is what callers use. It checks every argument before the backend
sees it (so every backend gets the same typed errors and the ledger never
changes on a bad call), keeps the fence tokens recorded on each reservation,
fences before every free and release (G2), and keeps the ledger.

The hot verbs (``fault``, ``free``) are bound once: with no observer wrapping
a verb, the session calls the backend's method directly instead of going
through pluggy's generic dispatch; with observers, it calls a hook caller that
holds only this backend and those observers. Observers may only wrap
(``wrapper=True`` or ``hookwrapper=True`` hookimpls): a plain hookimpl could
answer in the backend's place, so it is refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import operator
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn

import pluggy

from . import hookspec
from ._fences import FutureToken, work_died
from ._ledger import Ledger, still_running
from .types import (
    Budget,
    Candidate,
    Capabilities,
    ConfigError,
    Device,
    DriverError,
    DriverState,
    Fault,
    FenceToken,
    ForeignReservation,
    InvalidSize,
    InvalidToken,
    Machine,
    MembackendError,
    Misaligned,
    OutOfRange,
    PartialFailure,
    PluginError,
    Reservation,
    ReservationReleased,
    TensorAlive,
    WrongDevice,
)

log = logging.getLogger(__name__)

__all__ = ["Session", "MAX_RESERVATION", "HEADROOM_LIVE", "FENCE_WAIT"]

#: the ``call`` of the ``DriverError`` a fence raises when recorded asynchronous work failed
FENCE_WAIT = "fence token wait"

#: the ``source`` of :meth:`Session.set_headroom` for a change while running (the ComfyUI memory panel's
#: VRAM cap): it wins over every other source of the headroom
HEADROOM_LIVE = "live"
_LIVE, _FLAGS = 0, 1  # the levels a caller sets per device, highest first

#: The largest reservation a session passes to a backend: 2**48 bytes (256 TiB).
#: That is the whole user address space of x86-64 and AArch64 with 4-level page
#: tables, and more than any GPU driver's virtual address range for one
#: process, so no platform can hold a bigger range. A bigger size is a caller's
#: bug (a negative number cast to unsigned, a unit mix-up); refusing it up front
#: also keeps it from wrapping in a driver's ``size_t`` into a small, valid range.
MAX_RESERVATION = 1 << 48

#: argument names of each verb, in order, from the hookspecs themselves
_ARGNAMES: dict[str, tuple[str, ...]] = {
    verb: tuple(inspect.signature(getattr(hookspec, verb)).parameters) for verb in hookspec.VERBS
}


def _int(value: Any, what: str, accepted: str) -> int:
    """``value`` as an int, or ``InvalidSize`` naming what was given and what is accepted (no bools)."""
    if value.__class__ is not bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidSize(f"{what} must be an integer number of bytes, got {value!r} ({type(value).__name__}); "
                      f"accepted: {accepted}")


class _Permits:
    """The mutexes of a session's reservations: one *permit* each, a list holding ``True`` while it is free.

    Why not a ``threading.Lock`` per reservation: ``acquire()`` plus ``release()`` cost about as much as every
    other check of ``Session.fault`` together (they parse their arguments on every call), and the hot verbs
    are meant to cost little more than the backend's own method. Taking a permit is ``permit.pop()``,
    giving it back ``permit.append(True)``: each is atomic (one operation on a built-in list, under the
    interpreter's lock or, on a free-threaded build, the list's own), and the hot verbs inline both.

    A thread that finds a permit taken calls :meth:`wait`: under the condition it counts itself in
    :attr:`waiting` *before* it tries again; a releaser looks at :attr:`waiting` *after* it put the permit
    back and, when anyone waits, calls :meth:`wake`. Either the waiter's retry finds the permit or the
    releaser sees the waiter and wakes it: no wake-up is lost. Not reentrant; only the holder releases.
    """

    __slots__ = ("waiting", "_cond")

    def __init__(self) -> None:
        #: id(permit) -> how many threads wait for it; empty (false) while nobody waits
        self.waiting: dict[int, int] = {}
        self._cond = threading.Condition(threading.Lock())

    def wait(self, permit: list[bool]) -> None:
        """Block until this thread took ``permit`` (the slow part of an acquire)."""
        key = id(permit)
        with self._cond:
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                while True:
                    try:
                        permit.pop()
                        return
                    except IndexError:
                        self._cond.wait()
            finally:
                if self.waiting[key] == 1:
                    del self.waiting[key]
                else:
                    self.waiting[key] -= 1

    def wake(self) -> None:
        """Wake the waiters (the slow part of a release; each retries its own permit)."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, permit: list[bool]) -> Iterator[None]:
        """``with permits.held(permit):`` -- the permit taken for the block, as ``with lock:`` would."""
        try:
            permit.pop()
        except IndexError:
            self.wait(permit)
        try:
            yield
        finally:
            permit.append(True)
            if self.waiting:
                self.wake()

class Session:
    """Bound to exactly one backend; see the module docstring for the guarantees.

    Threads: a session may be called from several threads at once (a worker
    issuing verbs, copy threads calling :meth:`record`, a server thread
    unloading). Verbs on one reservation are serialised by a lock of that
    reservation (its *permit*, see :class:`_Permits`; "the reservation's lock"
    below); verbs on different reservations proceed independently (the
    backend must then be safe for concurrent calls on different reservations,
    as a real driver is). The ledger's updates are atomic. :meth:`record`
    racing :meth:`release_reservation` either records first, and the release
    waits for that token, or fails with ``ReservationReleased``: no token
    outlives its reservation. A fence token's ``wait()`` must not call back
    into the session on the same reservation (the reservation's lock is held).

    **Live tensor views.** ``membackend._tensors``' public functions register each
    tensor they make as a *view* of its byte range (:meth:`add_view`); the view
    ends when torch frees the tensor's storage (every tensor sharing it gone).
    :meth:`free` and :meth:`release_reservation` of a range a live view overlaps
    raise :class:`~membackend.types.TensorAlive` and change nothing, so a tensor
    never reads freed or reused memory. Registration is serialised with the
    reservation's other verbs; with no view on a reservation its frees pay one
    dict lookup.

    **The headroom** (the bytes every budget keeps free) has one owner, the
    session, and one precedence, highest first (:meth:`headroom_in_force`
    names the one in force on a device):

    1. a live change, ``set_headroom(device, n, source="live")`` (or any
       source starting with ``"live "``; the ComfyUI memory panel's VRAM cap);
    2. the caller's start-up flags, ``set_headroom(device, n, source=...)``
       with any other source (the adapter passes ComfyUI's
       ``--reserve-vram``/``--vram-headroom``);
    3. the ``headroom`` setting (``headroom=``, with ``headroom_source``
       naming where it came from: env, a file, kwargs);
    4. the backend's own rule (``own_headroom(device, total)``: a platform's
       rule with its declared settings, the host backend's default);
    5. what the backend's budget reports, for a backend without one.

    A backend that takes decisions on the headroom itself (the VMM backend
    refuses a fault past a unified pool up front) offers
    ``follow_headroom(decide)``: the session hands it its decision when it is
    built, so that backend never keeps a headroom of its own. The per-device
    table is guarded by one lock: :meth:`set_headroom` may race budget
    queries from any thread.

    ``tracer`` (a :class:`membackend._trace.TraceObserver` or None) wraps the
    verbs like any observer and is exposed as :attr:`tracer` for the layers
    above (the residency manager logs its decisions to it).
    """

    # bound by _bind: each verb of the backend (its own method, or a hook caller through the observers), each
    # optional hook's function or None; and the hot verbs' closures (_hot_verbs)
    _reserve: Callable[..., Any]
    _fault: Callable[..., Any]
    _free: Callable[..., Any]
    _release_reservation: Callable[..., Any]
    _fence: Callable[..., Any]
    _budget_query: Callable[..., Any]
    _opt_trim: Callable[..., Any] | None
    _opt_inspect: Callable[..., Any] | None
    _opt_inject_failures: Callable[..., Any] | None
    _opt_close: Callable[..., Any] | None
    _hot: dict[str, Callable[..., Any]]

    def __init__(self, backend: hookspec.Backend, *, machine: Machine, ledger: Ledger | None = None,
                 observers: Iterable[Any] = (), headroom: int | None = None, headroom_source: str | None = None,
                 candidate: Candidate | None = None, how: str = "forced", tracer: Any = None):
        self.backend = backend
        self.name: str = backend.name
        self.capabilities: Capabilities = getattr(backend, "capabilities", None) or Capabilities()
        self.device_kinds: tuple[str, ...] = tuple(getattr(backend, "device_kinds", ("cpu", "cuda", "hip")))
        self.machine = machine
        self.ledger = ledger or Ledger()
        self._pending_ids = self.ledger.pending_ids  # membership tests on the hot path
        self._resident_by_id = self.ledger.resident_by_id
        self._sanitize = self.ledger.sanitize
        if headroom is not None:
            headroom = _int(headroom, "the headroom setting", "an int >= 0, or None")
            if headroom < 0:
                raise InvalidSize(f"the headroom setting must be >= 0 bytes, got {headroom}; accepted: an int >= 0")
        self.headroom = headroom  # the ``headroom`` setting, level 3 of the precedence (None: not set)
        self._headroom_setting = f"start-up setting headroom (from {headroom_source or 'Session(headroom=...)'})"
        #: device -> {level (_LIVE, _FLAGS): (bytes, source)}; read and written under _headroom_lock
        self._headrooms: dict[Device, dict[int, tuple[int, str]]] = {}
        self._headroom_lock = threading.Lock()
        follow = getattr(backend, "follow_headroom", None)  # optional members: hookspec.OptionalMembers
        #: the backend's follow_headroom where it has one and own_headroom too, else None
        self._follow_headroom: Callable[..., None] | None = \
            follow if callable(follow) and callable(getattr(backend, "own_headroom", None)) else None
        self.candidate = candidate
        self.how = how
        self.tracer = tracer
        observers = list(observers)
        if tracer is not None and not any(o is tracer for o in observers):
            observers.append(tracer)
        #: live reservations of this session -> the permit (see _Permits) that serialises verbs on each
        self._live: dict[Reservation, list[bool]] = {}
        self._permits = _Permits()
        self._waiting = self._permits.waiting  # looked at by every release on the hot path
        #: reservations with (or recently with) live tensor views -> {view key: (offset, end)}; an entry is
        #: added under the reservation's lock, removed without any lock by the finalizer of the tensor's storage
        self._views: dict[Reservation, dict[int, tuple[int, int]]] = {}
        self._view_keys = itertools.count(1)
        #: reservation id -> how often a fence began and ended taking its waited tokens off (odd: under way);
        #: written under the reservation's lock, read without it by device-wide fences (:meth:`_may_have_work`)
        self._moving: dict[int, int] = {}
        #: reservation id -> how many frees of it reached the backend (:meth:`backing_changes`); written under
        #: the reservation's lock, read without it
        self._frees: dict[int, int] = {}
        #: the same, read-only, for a caller's hot path (the residency manager's warm ranges): a missing id is 0
        self.frees_by_id: Mapping[int, int] = self._frees
        known = self.devices()
        self._known = frozenset(known)
        self._known_kinds = frozenset(d.kind for d in known)
        self.observers: list[Any] = []
        self._bind(observers)
        if self._follow_headroom is not None:  # last: a session that failed to build leaves the backend as it was
            self._follow_headroom(self._decided_headroom)

    # ------------------------------------------------------------------ binding

    def _bind(self, observers: list[Any]) -> None:
        """Bind every verb for ``observers``; on a refused observer nothing changes."""
        pm = pluggy.PluginManager(hookspec.PROJECT)
        pm.add_hookspecs(hookspec)
        pm.register(self.backend, name=f"backend:{self.name}")
        for i, obs in enumerate(observers):
            label = f"observer {type(obs).__name__} (#{i})"
            try:
                pm.register(obs, name=f"observer:{i}:{type(obs).__name__}")
            except Exception as exc:
                raise PluginError(f"{label} cannot be registered: {exc}") from exc
            for caller in pm.get_hookcallers(obs) or ():
                for impl in caller.get_hookimpls():
                    if impl.plugin is obs and not (impl.wrapper or impl.hookwrapper):
                        raise PluginError(
                            f"{label} implements {caller.name} as a plain hookimpl, which could answer in the "
                            f"backend's place; accepted: observers mark every hookimpl @hookimpl(wrapper=True)")
        bound: dict[str, Callable[..., Any] | None] = {}
        for verb in hookspec.VERBS:
            caller = getattr(pm.hook, verb)
            wrapped = any(impl.plugin is not self.backend for impl in caller.get_hookimpls())
            bound["_" + verb.removeprefix("membackend_")] = (
                self._through(caller, _ARGNAMES[verb]) if wrapped else getattr(self.backend, verb))
        for name in hookspec.OPTIONAL_HOOKS:
            impls = [i for i in getattr(pm.hook, name).get_hookimpls() if i.plugin is self.backend]
            bound["_opt_" + name.removeprefix("membackend_")] = impls[0].function if impls else None
        self._pm = pm
        self.observers = list(observers)
        for attr, fn in bound.items():
            setattr(self, attr, fn)
        self._hot = self._hot_verbs()
        for verb, fn in self._hot.items():  # the instance's own: no bound method is made per call
            setattr(self, verb, fn)

    @staticmethod
    def _through(caller: Any, argnames: tuple[str, ...]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return caller(**dict(zip(argnames, args)))
        return call

    def add_observer(self, observer: Any) -> None:
        """Wrap the verbs with ``observer``'s ``wrapper=True`` hookimpls from now on.

        ``PluginError`` (and no change) when the observer has a plain hookimpl.
        """
        self._bind(self.observers + [observer])

    # ------------------------------------------------------------------ checks

    def _device(self, device: Any) -> Device:
        if device.__class__ is not Device:
            device = Device.parse(device)
        if device in self._known:
            return device
        if device.kind not in self.device_kinds:
            raise WrongDevice(f"backend {self.name!r} serves {', '.join(self.device_kinds)} devices, not {device}")
        if device.kind in self._known_kinds:  # the machine lists this kind: the index must be one of them
            have = ", ".join(str(d) for d in sorted(self._known) if d.kind == device.kind)
            raise WrongDevice(f"{device} is not a device of this machine; accepted: {have}")
        return device  # devices the machine facts do not list: the backend decides

    def _refuse(self, r: Any, verb: str) -> NoReturn:
        """Raise the typed error for a reservation that is not alive in this session."""
        if not isinstance(r, Reservation):
            raise WrongDevice(f"{verb} needs a Reservation from this session, got {type(r).__name__}")
        self.ledger.check_alive(r, verb)  # raises when released
        if r.backend != self.name:
            raise WrongDevice(f"reservation #{r.id} belongs to backend {r.backend!r}, not {self.name!r}")
        raise ForeignReservation(
            f"{verb}: reservation #{r.id} ({r.device}) was handed out by another session of backend "
            f"{self.name!r}; nothing was changed. Accepted: reservations this session reserved and has not released")

    def _lock_of(self, r: Any, verb: str) -> contextlib.AbstractContextManager[None]:
        """What ``with`` takes to hold ``r``'s permit; the typed error for a reservation not alive here."""
        try:
            return self._permits.held(self._live[r])
        except (KeyError, TypeError):
            self._refuse(r, verb)

    @staticmethod
    def _range(r: Reservation, offset: Any, size: Any) -> tuple[int, int]:
        if offset.__class__ is not int or size.__class__ is not int:
            offset = _int(offset, "offset", f"an int from 0 to {r.size - 1}")
            size = _int(size, "size", f"an int from 1 to {r.size}")
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}; accepted: 1 to {r.size} bytes")
        if offset < 0 or offset + size > r.size:
            raise OutOfRange(f"range [{offset}, {offset + size}) is outside reservation #{r.id} of {r.size} bytes; "
                             f"accepted: 0 <= offset and offset + size <= {r.size}")
        return offset, size

    # ------------------------------------------------------------------ verbs

    def devices(self) -> list[Device]:
        """The devices of this machine that the backend serves."""
        found = [Device("cpu", 0)] if "cpu" in self.device_kinds else []
        found += [d.device for d in self.machine.devices if d.device.kind in self.device_kinds]
        return found

    def reserve(self, device: Any, size: Any) -> Reservation:
        """Reserve at least ``size`` bytes (1 to :data:`MAX_RESERVATION`) of address space on ``device``.

        If anything fails after the backend reserved (a broken contract), the
        range is given back before the error is raised.
        """
        device = self._device(device)
        size = _int(size, "size", f"1 to {MAX_RESERVATION} bytes")
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}; accepted: 1 to {MAX_RESERVATION} bytes")
        if size > MAX_RESERVATION:
            raise InvalidSize(f"size {size} is more than any address space holds; accepted: 1 to "
                              f"{MAX_RESERVATION} bytes (2**48)")
        try:
            r = self._reserve(device, size)
        except Exception as exc:
            if (untyped := self._failed("reserve", exc)) is None:
                raise
            raise untyped from exc
        try:
            if not isinstance(r, Reservation) or r.size < size or r.device != device or r.page_size <= 0 \
                    or r.size % r.page_size or r.backend != self.name or r.released:
                raise PluginError(f"backend {self.name!r} broke the contract: reserve({device}, {size}) returned {r!r}")
            self.ledger.on_reserve(r)
            self._live[r] = [True]
        except BaseException:
            self._give_back(r)
            raise
        return r

    def fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        """Back every page of the range; ``Fault.ok`` false is out of memory (nothing changed).

        Each session answers this from the closure :meth:`_hot_verbs` made for it (an attribute of the
        instance); this method is what ``Session.fault(session, ...)`` reaches."""
        f: Fault = self._hot["fault"](reservation, offset, size)
        return f

    def free(self, reservation: Reservation, offset: int = 0, size: int | None = None) -> int:
        """Fence, then drop the resident pages of a page-aligned range (default: all). Returns bytes dropped.

        ``TensorAlive`` (nothing changed) while a tensor from ``membackend._tensors`` views the range. A
        reservation the ledger holds no resident byte of has nothing to drop: after the checks and the fence
        the free returns 0 without calling the backend. Answered like :meth:`fault`."""
        dropped: int = self._hot["free"](reservation, offset, size)
        return dropped

    def backing_changes(self, reservation: Reservation) -> int:
        """How many frees of ``reservation`` reached its backend so far (a failed one too, and a release that
        failed): each may have taken physical memory from pages of it, so the generations a fault answered
        before it may be stale. A caller that keeps a fault's answer to skip a copy (the residency manager's
        warm ranges) trusts it only while this count stands, so a free made by anyone -- another layer, a
        plugin holding this session -- is noticed. 0 for a reservation not alive in this session.
        Thread-safe, takes no lock."""
        return self._frees.get(reservation.id, 0)

    def _hot_verbs(self) -> dict[str, Callable[..., Any]]:
        """``fault`` and ``free`` as closures over what they use, made by :meth:`_bind` for the verbs as bound.

        Why closures: the hot verbs are meant to cost little more than the backend's own method, and every
        attribute of the session they read on each call was a measurable part of what they cost over it
        (``membackend bench``; ``docs/performance.md``). Each check is the one the session makes anywhere:
        the reservation alive here, the arguments, the permit (:class:`_Permits`), G2's fence before a free,
        the ledger.
        """
        live, permits, waiting, ledger, frees = self._live, self._permits, self._waiting, self.ledger, self._frees
        views, pending_ids, resident_by_id, sanitize = self._views, self._pending_ids, self._resident_by_id, \
            self._sanitize
        backend_fault, backend_free, refuse, in_range, failed = self._fault, self._free, self._refuse, \
            self._range, self._failed

        def fault(reservation: Reservation, offset: int, size: int) -> Fault:
            try:
                permit = live[reservation]
            except (KeyError, TypeError):
                refuse(reservation, "fault")
            if not (offset.__class__ is int and size.__class__ is int and 0 <= offset < offset + size
                    <= reservation.size):
                offset, size = in_range(reservation, offset, size)
            try:  # take the permit, inlined (see _Permits)
                permit.pop()
            except IndexError:
                permits.wait(permit)
            try:
                if reservation.released:  # released by another thread while this one waited
                    ledger.check_alive(reservation, "fault")
                try:
                    f: Fault = backend_fault(reservation, offset, size)
                except Exception as exc:
                    if (untyped := failed("fault", exc, reservation)) is None:
                        raise
                    raise untyped from exc
                if f.mapped:
                    ledger.on_fault(reservation, f.mapped)
            finally:
                permit.append(True)  # give it back, inlined
                if waiting:
                    permits.wake()
            return f

        def free(reservation: Reservation, offset: int = 0, size: int | None = None) -> int:
            try:
                permit = live[reservation]
            except (KeyError, TypeError):
                refuse(reservation, "free")
            if size is None:
                if offset.__class__ is not int:
                    offset = _int(offset, "offset", f"an int from 0 to {reservation.size - 1}")
                if not 0 <= offset < reservation.size:
                    raise OutOfRange(f"offset {offset} is outside reservation #{reservation.id} of "
                                     f"{reservation.size} bytes; accepted: 0 <= offset < {reservation.size}")
                size = reservation.size - offset
            if not (offset.__class__ is int and size.__class__ is int and 0 <= offset < offset + size
                    <= reservation.size):
                offset, size = in_range(reservation, offset, size)
            ps = reservation.page_size
            end = offset + size
            if offset % ps or end % ps:
                if offset % ps or end < reservation.requested:
                    raise Misaligned(f"free range [{offset}, {end}) must start on a page boundary and end on one "
                                     f"(or at the end of the reservation); page size {ps}")
                size = reservation.size - offset  # the tail page holds only this caller's bytes
            try:  # take the permit, inlined (see _Permits)
                permit.pop()
            except IndexError:
                permits.wait(permit)
            try:
                if reservation.released:
                    ledger.check_alive(reservation, "free")
                if reservation in views:
                    self._check_views(reservation, offset, size, "free")
                if reservation.id in pending_ids:
                    self._wait_tokens(reservation)
                if sanitize:
                    ledger.check_quiet(reservation, "free")
                if not resident_by_id.get(reservation.id):
                    return 0  # the ledger holds no byte of it resident: nothing for the backend to drop
                # counted before the call: one that raises may have dropped pages too (backing_changes)
                frees[reservation.id] = frees.get(reservation.id, 0) + 1
                try:
                    dropped: int = backend_free(reservation, offset, size)
                except Exception as exc:
                    if (untyped := failed("free", exc, reservation)) is None:
                        raise
                    raise untyped from exc
                if dropped:
                    ledger.on_free(reservation, dropped)
            finally:
                permit.append(True)  # give it back, inlined
                if waiting:
                    permits.wake()
            return dropped

        return {"fault": fault, "free": free}

    def release_reservation(self, reservation: Reservation) -> int:
        """Fence, drop every page and return the address range; the reservation is dead afterwards.

        ``TensorAlive`` (nothing changed) while a tensor from ``membackend._tensors`` views any of it."""
        lock = self._lock_of(reservation, "release_reservation")
        with lock:
            if reservation.released:  # a concurrent release won
                self.ledger.check_alive(reservation, "release_reservation")
            if reservation in self._views:
                self._check_views(reservation, 0, reservation.size, "release_reservation")
            self._wait_tokens(reservation)
            self.ledger.check_quiet(reservation, "release_reservation")
            # counted as a free (backing_changes): one that raises may have dropped pages and left it alive
            self._frees[reservation.id] = self._frees.get(reservation.id, 0) + 1
            try:
                dropped = self._release_reservation(reservation)
            except Exception as exc:
                if (untyped := self._failed("release_reservation", exc, reservation)) is None:
                    raise
                raise untyped from exc
            reservation.released = True
            self.ledger.on_release(reservation)
            self._live.pop(reservation, None)
            self._views.pop(reservation, None)
            self._moving.pop(reservation.id, None)
            self._frees.pop(reservation.id, None)
        return dropped

    # ------------------------------------------------------------------ tensor views

    def add_view(self, reservation: Reservation, offset: int, size: int) -> Callable[[], None]:
        """Register a live view of ``[offset, offset+size)``: until the returned callable is called,
        :meth:`free` and :meth:`release_reservation` of an overlapping range raise ``TensorAlive``.

        ``membackend._tensors`` calls it before it faults the range and ties the returned callable
        to the tensor's storage (``weakref.finalize``), so the view ends when the storage is freed.
        The callable takes no lock and may run on any thread (the garbage collector's included);
        calling it twice is harmless.
        """
        lock = self._lock_of(reservation, "add_view")
        offset, size = self._range(reservation, offset, size)
        key = next(self._view_keys)
        with lock:
            if reservation.released:
                self.ledger.check_alive(reservation, "add_view")
            views = self._views.get(reservation)
            if views is None:
                views = self._views[reservation] = {}
            views[key] = (offset, offset + size)
        end_view: Callable[[], None] = functools.partial(views.pop, key, None)  # type: ignore[assignment]
        return end_view  # (what pop returns is of no use to the caller: it only ends the view)

    def views(self, reservation: Reservation, offset: int = 0, size: int | None = None) -> list[tuple[int, int]]:
        """The byte ranges ``(offset, end)`` of live tensor views overlapping ``[offset, offset+size)``
        (default: the whole reservation); a snapshot, empty when there are none."""
        views = self._views.get(reservation)
        if not views:
            return []
        end = reservation.size if size is None else offset + size
        return [(a, b) for a, b in views.copy().values() if a < end and offset < b]

    def _check_views(self, reservation: Reservation, offset: int, size: int, verb: str) -> None:
        """Raise ``TensorAlive`` when a live view overlaps the range (the reservation's lock held)."""
        views = self._views[reservation]
        if not views:  # every view ended: stop paying for the check (add_view re-creates it under this lock)
            del self._views[reservation]
            return
        end = offset + size
        held = [(a, b) for a, b in views.copy().values() if a < end and offset < b]
        if held:
            raise TensorAlive(verb, reservation, offset, size, held)

    def record(self, reservation: Reservation, token: FenceToken | Future) -> None:
        """Note asynchronous work (a copy, a kernel) on the reservation; fences wait for it.

        ``token`` is a fence token (callable ``done()`` and ``wait()``: a GPU event token, a
        ``FutureToken``) or a :class:`concurrent.futures.Future` of the work, e.g. a copy thread's
        ``executor.submit(copy)``: it is wrapped in a :class:`membackend._fences.FutureToken`, finished
        when ``done()`` is true and waited for with ``result()``, so a copy that raised makes the next
        fence raise ``DriverError`` once instead of passing for finished -- also when its thread stopped
        with ``KeyboardInterrupt`` or ``SystemExit``, which never reaches the fencing thread as such.
        Anything else is ``InvalidToken`` and nothing is recorded.

        Serialised with the reservation's other verbs: a record that loses a
        race with ``release_reservation`` raises ``ReservationReleased`` and
        keeps nothing.
        """
        lock = self._lock_of(reservation, "record")
        if isinstance(token, Future):  # has done() but no wait(): result() is its wait
            token = FutureToken(token)
        try:
            ok = callable(getattr(token, "done", None)) and callable(getattr(token, "wait", None))
        except Exception:
            ok = False
        if not ok:
            raise InvalidToken(f"a fence token needs done() and wait(); got {type(token).__name__} {token!r}; "
                               f"accepted: an object with callable done() and wait() (an event token, a FutureToken) "
                               f"or a concurrent.futures.Future")
        with lock:
            if reservation.released:
                self.ledger.check_alive(reservation, "record")
            self.ledger.record(reservation, token)

    def fence(self, device: Any = None, reservation: Reservation | None = None) -> None:
        """Wait for recorded work on the reservation, or on the whole device when it is None.

        Returns only after every token recorded before it began has finished
        (G2), including tokens another thread's ``free``, ``release_reservation``
        or fence is waiting for at that moment: they stay recorded until that
        wait completed, and this fence then waits for the reservation's lock.
        A device-wide fence waits for each reservation's tokens under that
        reservation's lock, one reservation at a time, so a concurrent free of
        one of them waits too; reservations with nothing recorded are skipped
        without taking their lock. A failed or died copy raises ``DriverError``
        once (see :meth:`_wait_tokens`); a device-wide fence first waits for
        every other reservation, then raises the first failure.
        """
        if reservation is not None:
            lock = self._lock_of(reservation, "fence")
            if device is not None and Device.parse(device) != reservation.device:
                raise WrongDevice(f"reservation #{reservation.id} is on {reservation.device}, not {device}")
            with lock:
                if reservation.released:
                    self.ledger.check_alive(reservation, "fence")
                self._wait_tokens(reservation)
                self._backend_fence(reservation.device, reservation)
            return
        if device is None:
            raise WrongDevice("fence needs a device or a reservation")
        device = self._device(device)
        errors: list[BaseException] = []
        for r, permit in list(self._live.items()):
            if r.device != device or not self._may_have_work(r):
                continue
            with self._permits.held(permit):
                if not r.released:
                    try:
                        self._wait_tokens(r)
                    except MembackendError as exc:  # the others are still waited for; their tokens are kept
                        errors.append(exc)
        if errors:
            raise errors[0]
        self._backend_fence(device, None)

    def _backend_fence(self, device: Device, reservation: Reservation | None) -> None:
        try:
            self._fence(device, reservation)
        except Exception as exc:
            if (untyped := self._failed("fence", exc)) is None:
                raise
            raise untyped from exc

    def page_size(self, device: Any) -> int:
        """The page size the backend maps on ``device``, in bytes: the ``page_size`` of every reservation made
        there (the backend's optional ``page_size_on(device)``, else its ``page_size``, else 2 MiB). A backend
        that fails raises its error, typed as every hook's (``PluginError`` for an untyped one)."""
        d = self._device(device)
        per_device = getattr(self.backend, "page_size_on", None)
        if not callable(per_device):
            return int(getattr(self.backend, "page_size", 2 << 20))
        try:
            return int(per_device(d))
        except Exception as exc:
            if (untyped := self._failed("page_size_on", exc)) is None:
                raise
            raise untyped from exc

    def tensor_device(self, device: Any) -> str:
        """The torch device that reads the backend's memory on ``device``: ``cpu`` for host memory, or
        where the backend says its device memory is memory of this process the CPU addresses directly
        (its optional ``tensor_device(device)`` method); else ``cuda:N`` (torch's ROCm build calls HIP
        devices ``cuda`` too). A backend's answer that is not a torch device string is a ``PluginError``."""
        d = self._device(device)
        fn = getattr(self.backend, "tensor_device", None)
        if callable(fn):
            try:
                where = fn(d)
            except Exception as exc:
                if (untyped := self._failed("tensor_device", exc)) is None:
                    raise
                raise untyped from exc
            if not isinstance(where, str) or not where or where.split(":")[0] not in ("cpu", "cuda"):
                raise PluginError(f"backend {self.name!r} broke the contract: tensor_device({d}) returned "
                                  f"{where!r}; accepted: 'cpu' or 'cuda:N'")
            return where
        return "cpu" if d.kind == "cpu" else f"cuda:{d.index}"

    def host_unregister(self, address: int) -> bool:
        """Ends a page-locking of host memory at ``address`` through the backend's optional
        ``host_unregister(address)`` (a GPU backend's driver); True when one started there. False where the
        backend has no such member (its devices read host memory as it is: nothing to unregister). A backend
        that fails raises its error, typed as every hook's (``PluginError`` for an untyped one)."""
        fn = getattr(self.backend, "host_unregister", None)
        if not callable(fn):
            return False
        try:
            return bool(fn(int(address)))
        except Exception as exc:
            if (untyped := self._failed("host_unregister", exc)) is None:
                raise
            raise untyped from exc

    def budget_query(self, device: Any) -> Budget:
        """The backend's budget, with the headroom in force on ``device`` (:meth:`headroom_in_force`)."""
        device = self._device(device)
        b = self._checked_budget(self._budget_query, device)
        room = self._in_force(device, b.total, b.headroom)[0]
        if room != b.headroom:  # a following backend asked this session already: no change then
            b = Budget.of(b.total, b.free, room, b.source, b.unified)
        return b

    def free_for_host(self, device: Any) -> int:
        """The free bytes the host application is told about (ComfyUI's ``get_free_memory``): the budget's
        free memory minus the headroom in force *apart from the host's own start-up flags* (``set_headroom``
        with a source other than live), clamped at 0. One budget query.

        The host accounts for its own flags itself: ComfyUI's ``--reserve-vram`` reaches its load sizing
        through ``extra_reserved_memory()``, and neither it nor ``--vram-headroom`` changes what stock
        ComfyUI's ``get_free_memory`` answers (they bound comfy-aimdo's weights only). Subtracting them here
        as well counted them twice, and changed ComfyUI's choices that read the figure (cond batching in
        ``samplers.calc_cond_batch``, attention slicing, VAE batches), so images under a flag differed from
        stock's under the same flag. The flags still bound the weights: every fault's budget keeps them
        (:meth:`budget_query`). A live change, the ``headroom`` setting and the backend's own rule are
        membackend's own and stay subtracted."""
        device = self._device(device)
        b = self._checked_budget(self._budget_query, device)  # the backend's own headroom in b.headroom
        with self._headroom_lock:
            levels = {k: v for k, v in (self._headrooms.get(device) or {}).items() if k != _FLAGS}
        if levels:
            room = levels[min(levels)][0]
        elif self.headroom is not None:
            room = self.headroom
        else:
            own = getattr(self.backend, "own_headroom", None)
            room = int(own(device, b.total)[0]) if callable(own) else b.headroom
        return max(0, b.free - room)

    def room_split(self, device: Any) -> Any:
        """Where the device's memory goes, as the backend measures it (``VmmBackend.room_split``: the room
        the headroom in force leaves, the process's other use, the weights' room, membackend's resident
        bytes), or None where the backend cannot say (``host``, ``aimdo``). The status shows it."""
        device = self._device(device)
        split = getattr(self.backend, "room_split", None)
        return split(device) if callable(split) else None

    def headroom_in_force(self, device: Any) -> tuple[int, str]:
        """``(bytes kept free on device, where that value comes from, in words)``, by the precedence of
        the class docstring: the ``source`` given to :meth:`set_headroom` (``live``, ComfyUI's flags),
        ``start-up setting headroom (from env MEMBACKEND_HEADROOM)``, the backend's or platform's own
        (``platform unified_gb10's own rule``, ``backend host's own rule (512.0 MiB)``): every one of these
        reads ``<platform|backend> NAME's own rule``, with what it is made of in brackets where that helps."""
        device = self._device(device)
        chosen = self._chosen_headroom(device)
        if chosen is not None:
            return chosen
        b = self._checked_budget(self.backend.membackend_budget_query, device)  # not traced: no caller asked
        return self._in_force(device, b.total, b.headroom)

    def _in_force(self, device: Device, total: int, reported: int) -> tuple[int, str]:
        """The one precedence: a value set through :meth:`set_headroom`, else the backend's own rule
        (``own_headroom``), else the headroom its budget ``reported``."""
        chosen = self._chosen_headroom(device)
        if chosen is not None:
            return chosen
        own = getattr(self.backend, "own_headroom", None)
        if callable(own):
            room, source = own(device, total)
            return int(room), str(source)
        return reported, f"backend {self.name}'s own rule (the headroom its budget reports)"

    def set_headroom(self, device: Any, headroom: int | None, source: str = HEADROOM_LIVE) -> None:
        """Keep ``headroom`` bytes free on ``device`` from the next budget query on, as ``source``.

        ``source`` is :data:`HEADROOM_LIVE` (``"live"``, or words starting with ``"live "``: a change
        while running, the memory panel's) or the start-up flags the value comes from (the ComfyUI
        adapter passes ``"comfyui --reserve-vram/--vram-headroom"``); :meth:`headroom_in_force` names it
        with these very words. Each level holds one value per device, and a live value wins (see the
        class docstring). ``headroom`` None takes that source's value away: the next source in the
        precedence applies again. Thread-safe.

        Raises ``InvalidSize`` (nothing changes) for a headroom that is not an int from 0 to the device's
        total bytes (the message gives the range), ``ConfigError`` for a ``source`` that is no text.
        """
        device = self._device(device)
        if not isinstance(source, str) or not source.strip():
            raise ConfigError("source", "Session.set_headroom", f"{source!r} names no source",
                              f"{HEADROOM_LIVE!r}, or the start-up flags the value comes from, e.g. "
                              "'comfyui --reserve-vram/--vram-headroom'")
        level = _LIVE if source == HEADROOM_LIVE or source.startswith(HEADROOM_LIVE + " ") else _FLAGS
        if headroom is None:
            with self._headroom_lock:
                levels = self._headrooms.get(device)
                if levels is not None:
                    levels.pop(level, None)
                    if not levels:
                        del self._headrooms[device]
            return
        total = self._checked_budget(self.backend.membackend_budget_query, device).total
        accepted = f"an int from 0 to {total} (the total bytes of {device})"
        n = _int(headroom, "headroom", accepted)
        if not 0 <= n <= total:
            raise InvalidSize(f"headroom {n} bytes on {device} is outside 0 to {total} bytes, the device's total; "
                              f"accepted: {accepted}")
        with self._headroom_lock:
            self._headrooms.setdefault(device, {})[level] = (n, source)

    def _chosen_headroom(self, device: Device) -> tuple[int, str] | None:
        """Levels 1-3 of the precedence: a live change, the start-up flags, the setting; None: none is set."""
        with self._headroom_lock:
            levels = self._headrooms.get(device)
            if levels:
                return levels[min(levels)]
        if self.headroom is not None:
            return self.headroom, self._headroom_setting
        return None

    def _decided_headroom(self, device: Device, total: int) -> int:
        """The headroom in force, for a backend that follows the session (``follow_headroom``)."""
        return self._in_force(device, total, 0)[0]  # a following backend has its own rule

    def _checked_budget(self, query: Callable[[Device], Any], device: Device) -> Budget:
        """A budget from ``query`` (the bound verb, or the backend itself), typed as every verb is."""
        try:
            b = query(device)
        except Exception as exc:
            if (untyped := self._failed("budget_query", exc)) is None:
                raise
            raise untyped from exc
        if not isinstance(b, Budget):
            raise PluginError(f"backend {self.name!r} broke the contract: budget_query returned {b!r}")
        return b

    def reservations(self) -> list[Reservation]:
        """Every reservation of this session that is still alive."""
        return list(self._live)

    # ------------------------------------------------------------------ optional hooks, close

    def served(self) -> list[Device]:
        """Every device this session has reserved on."""
        return self.ledger.devices()

    def trim(self, device: Any = None) -> int:
        """Give back what the backend keeps for reuse (``membackend_trim``) on ``device``, or on every
        device this session served; returns the bytes given back (0 without the hook).

        Trimming several devices carries on past failures and then raises one
        ``PartialFailure`` naming each.
        """
        devices = [self._device(device)] if device is not None else self.served()
        fn = self._opt_trim
        if fn is None:
            return 0
        total, failures = 0, []
        for d in devices:
            try:
                try:
                    n = fn(device=d)
                except Exception as exc:
                    if (untyped := self._failed("trim", exc)) is None:
                        raise
                    raise untyped from exc
                if n.__class__ is bool or not isinstance(n, int) or n < 0:
                    raise PluginError(f"backend {self.name!r} broke the contract: trim({d}) returned {n!r}, "
                                      f"not a byte count >= 0")
                total += n
            except MembackendError as exc:
                if device is not None:
                    raise
                failures.append((f"trim({d})", exc))
        if failures:
            raise PartialFailure("trim", failures)
        return total

    def inspect(self, device: Any) -> DriverState | None:
        """The driver's own view of ``device`` (``membackend_inspect``); None without the hook."""
        device = self._device(device)
        fn = self._opt_inspect
        if fn is None:
            return None
        try:
            state = fn(device=device)
        except Exception as exc:
            if (untyped := self._failed("inspect", exc)) is None:
                raise
            raise untyped from exc
        if state is not None and not isinstance(state, DriverState):
            raise PluginError(f"backend {self.name!r} broke the contract: inspect({device}) returned {state!r}")
        return state

    def close(self) -> int:
        """Release every reservation still alive, trim every device served, then let the backend give back what
        it holds of the driver (``membackend_close``); returns how many reservations were released.

        Carries on past failures; if any, raises one ``PartialFailure`` naming
        each (what could be released and trimmed was). A recorded copy that
        failed and was never fenced is reported here (a ``fence(...)`` failure)
        and its reservation is still released: the failed copy counts as
        finished, so nothing keeps the range (G1).
        """
        failures: list[tuple[str, BaseException]] = []
        released = 0
        for r in list(self._live):
            if r.released or r not in self._live:
                continue  # released by another thread meanwhile
            if self._may_have_work(r):  # a copy that failed unreported is reported here, not a reason to keep r
                try:
                    self.fence(None, r)
                except ReservationReleased:
                    continue
                except MembackendError as exc:
                    failures.append((f"fence(#{r.id} on {r.device})", exc))
            try:
                self.release_reservation(r)
                released += 1
            except ReservationReleased:
                continue  # released by another thread between the check and the release
            except MembackendError as exc:
                failures.append((f"release_reservation(#{r.id} on {r.device})", exc))
        try:
            self.trim()
        except PartialFailure as exc:
            failures += exc.failures
        except MembackendError as exc:
            failures.append(("trim", exc))
        if self._follow_headroom is not None:  # a closed session decides nothing for the backend any more
            self._follow_headroom(None, instead_of=self._decided_headroom)
        if self._opt_close is not None:  # what the backend holds of the driver itself (a primary context)
            try:
                self._opt_close()
            except Exception as exc:
                failures.append(("close", exc if isinstance(exc, MembackendError) else
                                 PluginError(f"backend {self.name!r} raised {type(exc).__name__} in close: {exc}")))
        if self.tracer is not None:  # the trace file it wrote: closed with the session that owns it
            self.tracer.close()
        if failures:
            raise PartialFailure("close", failures)
        return released

    # ------------------------------------------------------------------ internals

    def _give_back(self, r: Any) -> None:
        """Return a reservation that failed after the backend made it; never raises."""
        if not isinstance(r, Reservation):
            return  # nothing a backend could release
        self._live.pop(r, None)
        self._views.pop(r, None)
        self.ledger.forget(r)
        try:
            self._release_reservation(r)
        except Exception as exc:
            log.error("membackend: backend %r could not give back reservation #%s after a failed reserve: %s",
                      self.name, r.id, exc)

    def _failed(self, verb: str, exc: Exception, reservation: Reservation | None = None) -> PluginError | None:
        """Account for a verb that raised; return the typed error to raise instead, or None to re-raise.

        A ``DriverError`` may carry the bytes the backend still changed before it
        failed (``mapped`` by a fault whose rollback could not unmap, ``dropped``
        by a free or release that stopped half-way): the ledger takes them, so it
        keeps matching the driver. Anything that is not a membackend error is a
        broken backend, and G6 wants it typed.
        """
        if isinstance(exc, DriverError) and reservation is not None:
            self.ledger.on_fault(reservation, getattr(exc, "mapped", 0))
            self.ledger.on_free(reservation, getattr(exc, "dropped", 0))
        if isinstance(exc, MembackendError):
            return None
        log.error("membackend: backend %r raised %s in %s: %s", self.name, type(exc).__name__, verb, exc)
        return PluginError(f"backend {self.name!r} raised {type(exc).__name__} in {verb}: {exc}")

    def _wait_tokens(self, reservation: Reservation) -> None:
        """Wait for every token recorded on ``reservation`` (its lock held).

        The tokens stay recorded -- visible to a device-wide :meth:`fence` on
        another thread -- until their waits have completed, so that fence
        waits for them too instead of passing a copy still running (G2). Under
        the reservation's lock nobody else records or takes its tokens, so the
        snapshot waited for is what is then taken (:meth:`_settle`).

        Every token is waited for even when one fails; then every token whose
        ``done()`` says it is still running is kept, so the next fence waits
        again (G2); a failed token (``wait()`` raised and ``done()`` is true or
        raises) is reported once and counts as finished (G1); the first failure
        is raised typed: a ``DriverError`` with call :data:`FENCE_WAIT` (a
        membackend error a token raised passes as it is). A copy whose own thread
        stopped with ``KeyboardInterrupt`` or ``SystemExit`` (a future holding it,
        :func:`~membackend._fences.work_died`) is such a failure too, never
        re-raised in this thread (G6). A ``BaseException`` that is not the
        work's own (the caller's thread interrupted while it waits) propagates
        and every token stays recorded.
        """
        tokens = self.ledger.pending(reservation)
        if not tokens:
            return
        errors: list[BaseException] = []
        for t in tokens:
            try:
                t.wait()
            except Exception as exc:
                errors.append(exc)
            except BaseException as exc:
                if not work_died(t, exc):
                    raise  # the caller's own thread was interrupted: nothing taken, every token stays recorded
                errors.append(exc)
        left = self._settle(reservation, tokens, failed=bool(errors))
        if not errors:
            return
        first = errors[0]
        if isinstance(first, MembackendError):
            raise first
        count = len(tokens)
        what = str(first)
        if not isinstance(first, Exception):  # KeyboardInterrupt, SystemExit: the work's thread stopped
            what = (f"{what + ': ' if what else ''}the recorded work's own thread stopped with "
                    f"{type(first).__name__} before it finished, so what it wrote to the range is undefined "
                    f"(copy it again); accepted: work that finishes, or fails with an Exception")
        raise DriverError(type(first).__name__, FENCE_WAIT,
                          f"{what} ({len(errors)} of {count} token(s) on reservation #{reservation.id} failed; "
                          f"{left} still running kept for the next fence, the failed ones count as finished)") \
            from first

    def _settle(self, reservation: Reservation, waited: list[FenceToken], failed: bool) -> int:
        """Take the tokens just ``waited`` for off ``reservation`` (its lock held); returns how many of them
        are kept because they are still running.

        After waits that all returned every one has finished; after a wait that
        ``failed``, the ones still running are kept (G2) and the failed ones count
        as finished (reported once). Anything recorded past the reservation's
        lock meanwhile (straight into the ledger) is not this fence's to drop:
        it stays, for the sanitizer to see. The ledger takes and puts back in two
        steps; the odd count in ``_moving`` tells a device fence that it must
        not trust what the ledger says in between (:meth:`_may_have_work`).
        """
        rid = reservation.id
        self._moving[rid] = self._moving.get(rid, 0) + 1
        try:
            taken = self.ledger.take_pending(reservation.device, reservation)
            dev, now = taken.get(rid, (reservation.device, []))
            mine = Counter(map(id, waited))
            kept, running = [], 0
            for t in now:
                if not mine[id(t)]:
                    kept.append(t)  # recorded past the lock while this fence waited
                elif failed and still_running(t):
                    mine[id(t)] -= 1
                    kept.append(t)
                    running += 1
                else:
                    mine[id(t)] -= 1
            if kept:
                self.ledger.restore_pending({rid: (dev, kept)})
        finally:
            self._moving[rid] += 1
        return running

    def _may_have_work(self, r: Reservation) -> bool:
        """Whether tokens recorded on ``r`` may still be unfinished, without taking its lock (a device fence).

        A token stays recorded until its wait completed, except while a fence
        takes the waited ones off and puts back those it keeps (:meth:`_settle`,
        two steps in the ledger): the count of those moves, odd while one is
        under way and read on both sides of the check, says whether the answer
        could have missed one. False is then safe: nothing recorded before the
        check is unfinished.
        """
        moves = self._moving.get(r.id, 0)
        return r.id in self._pending_ids or moves % 2 == 1 or self._moving.get(r.id, 0) != moves
