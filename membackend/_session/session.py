"""The front: :class:`Session`, composed of the parts of :mod:`.parts` (the package docstring is the story)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping

from .. import hookspec
from .._ledger import Ledger
from ..platform import HEADROOM_LIVE, HeadroomByDevice
from ..types import Budget, Candidate, Capabilities, Device, DriverState, FenceToken, Machine, Reservation
from .checks import Checks
from .headroom import hand_down, headroom_table
from .hot import FaultVerb, FreeVerb
from .lifecycle import close_session
from .members import Members
from .parts import Books, Parts, compose


class Session:
    """Bound to exactly one backend; see the package docstring for the guarantees.

    Threads: a session may be called from several threads at once (a worker
    issuing verbs, copy threads calling :meth:`record`, a server thread
    unloading). Verbs on one reservation are serialised by a lock of that
    reservation (its *permit*, see :class:`~.permits.Permits`; "the reservation's
    lock" below); verbs on different reservations proceed independently (the
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
    session, one object per device (:attr:`headrooms`, a
    :class:`~membackend.platform.Headroom` each) and one precedence, highest
    first (:meth:`headroom_in_force` names the one in force on a device):

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

    A backend that takes decisions on the headroom itself (the VMM backend refuses a fault past a unified
    pool up front) offers ``use_headroom(headroom_by_device)``: the session hands it :attr:`headrooms` when it
    is built, so that backend keeps no headroom of its own and a budget query computes the precedence once, in
    the backend. Thread-safe: :meth:`set_headroom` may race budget queries from any thread.

    ``tracer`` (a :class:`membackend._trace.TraceObserver` or None) wraps the verbs like any observer and is
    exposed as :attr:`tracer` for the layers above (the residency manager logs its decisions to it).
    """

    #: the hot verbs: closures over what they use (:func:`.hot.hot_verbs`), installed on the instance when the
    #: verbs are bound; their contracts are :class:`~.hot.FaultVerb` and :class:`~.hot.FreeVerb`
    fault: FaultVerb
    free: FreeVerb
    _parts: Parts

    def __init__(self, backend: hookspec.Backend, *, machine: Machine, ledger: Ledger | None = None,
                 observers: Iterable[Any] = (), headroom: int | None = None, headroom_source: str | None = None,
                 candidate: Candidate | None = None, how: str = "forced", tracer: Any = None):
        self.backend = backend
        self.name: str = backend.name
        #: the backend's optional members, read once (``hookspec.OptionalMembers``)
        self.members = members = Members.read(backend)
        self.capabilities: Capabilities = members.capabilities
        self.device_kinds: tuple[str, ...] = members.device_kinds
        self.machine = machine
        self.ledger = ledger or Ledger()
        #: device -> its :class:`~membackend.platform.Headroom` (checks the ``headroom`` setting: InvalidSize)
        self.headrooms: HeadroomByDevice
        self.headrooms, self.headroom = headroom_table(self.name, members, headroom, headroom_source)
        self.candidate = candidate
        self.how = how
        self.tracer = tracer
        observers = list(observers)
        if tracer is not None and not any(o is tracer for o in observers):
            observers.append(tracer)
        checks = Checks(self.name, self.device_kinds, self.devices(), self.ledger.check_alive,
                        self.ledger.on_fault, self.ledger.on_free)
        self._books = Books(backend, self.name, members, checks, self.ledger, self.headrooms)
        #: reservation id -> how many frees of it reached the backend, read-only (a missing id is 0)
        self.frees_by_id: Mapping[int, int] = self._books.frees
        self.observers: list[Any] = []
        self._bind(observers)
        # last: a session that failed to build leaves the backend as it was
        self._take_back_headroom = hand_down(backend, members, self.headrooms)

    def _bind(self, observers: list[Any]) -> None:
        """Compose the parts for ``observers`` and install the hot verbs; on a refused observer nothing changes."""
        parts = compose(self._books, observers)
        self._parts = parts
        self.observers = list(observers)
        self.fault, self.free = parts.fault, parts.free  # the instance's own: no bound method is made per call

    def add_observer(self, observer: Any) -> None:
        """Wrap the verbs with ``observer``'s ``wrapper=True`` hookimpls from now on.

        ``PluginError`` (and no change) when the observer has a plain hookimpl.
        """
        self._bind(self.observers + [observer])

    # ------------------------------------------------------------------ verbs

    def devices(self) -> list[Device]:
        """The devices of this machine that the backend serves."""
        found = [Device("cpu", 0)] if "cpu" in self.device_kinds else []
        found += [d.device for d in self.machine.devices if d.device.kind in self.device_kinds]
        return found

    def reserve(self, device: Any, size: Any) -> Reservation:
        """Reserve at least ``size`` bytes (1 to :data:`~.checks.MAX_RESERVATION`) of address space on ``device``.

        If anything fails after the backend reserved (a broken contract), the
        range is given back before the error is raised.
        """
        return self._parts.lifecycle.reserve(device, size)

    def release_reservation(self, reservation: Reservation) -> int:
        """Fence, drop every page and return the address range; the reservation is dead afterwards.

        ``TensorAlive`` (nothing changed) while a tensor from ``membackend._tensors`` views any of it."""
        return self._parts.lifecycle.release(reservation)

    def backing_changes(self, reservation: Reservation) -> int:
        """How many frees of ``reservation`` reached its backend so far (a failed one too, and a release that
        failed): each may have taken physical memory from pages of it, so the generations a fault answered
        before it may be stale. A caller that keeps a fault's answer to skip a copy (the residency manager's
        warm ranges) trusts it only while this count stands, so a free made by anyone -- another layer, a
        plugin holding this session -- is noticed. 0 for a reservation not alive in this session.
        Thread-safe, takes no lock."""
        return self._books.frees.get(reservation.id, 0)

    def add_view(self, reservation: Reservation, offset: int, size: int) -> Callable[[], None]:
        """Register a live view of ``[offset, offset+size)``: until the returned callable is called,
        :meth:`free` and :meth:`release_reservation` of an overlapping range raise ``TensorAlive``.

        ``membackend._tensors`` calls it before it faults the range and ties the returned callable
        to the tensor's storage (``weakref.finalize``), so the view ends when the storage is freed.
        The callable takes no lock and may run on any thread (the garbage collector's included);
        calling it twice is harmless.
        """
        return self._books.views.add(reservation, offset, size)

    def views(self, reservation: Reservation, offset: int = 0, size: int | None = None) -> list[tuple[int, int]]:
        """The byte ranges ``(offset, end)`` of live tensor views overlapping ``[offset, offset+size)``
        (default: the whole reservation); a snapshot, empty when there are none."""
        return self._books.views.overlapping(reservation, offset, size)

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
        self._parts.fencing.record(reservation, token)

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
        once (see :meth:`.fencing.Fencing.wait_tokens`); a device-wide fence first
        waits for every other reservation, then raises the first failure.
        """
        self._parts.fencing.fence(device, reservation)

    def reservations(self) -> list[Reservation]:
        """Every reservation of this session that is still alive."""
        return list(self._books.live)

    # ------------------------------------------------------------------ the headroom and the budget

    def budget_query(self, device: Any) -> Budget:
        """The backend's budget, with the headroom in force on ``device`` (:meth:`headroom_in_force`)."""
        return self._parts.headroom.budget_query(device)

    def free_for_host(self, device: Any) -> int:
        """The free bytes the host application is told about (ComfyUI's ``get_free_memory``): the budget's
        free memory minus the headroom in force *apart from the host's own start-up flags* (``set_headroom``
        with a source other than live), clamped at 0. One budget query. The host accounts for its own flags
        itself (why: :meth:`.headroom.SessionHeadroom.free_for_host`); every fault's budget keeps them
        (:meth:`budget_query`). A live change, the ``headroom`` setting and the backend's own rule stay
        subtracted."""
        return self._parts.headroom.free_for_host(device)

    def headroom_in_force(self, device: Any) -> tuple[int, str]:
        """``(bytes kept free on device, where that value comes from, in words)``, by the precedence of
        the class docstring: the ``source`` given to :meth:`set_headroom` (``live``, ComfyUI's flags),
        ``start-up setting headroom (from env MEMBACKEND_HEADROOM)``, the backend's or platform's own
        (``platform unified_gb10's own rule``, ``backend host's own rule (512.0 MiB)``): every one of these
        reads ``<platform|backend> NAME's own rule``, with what it is made of in brackets where that helps."""
        return self._parts.headroom.in_force(device)

    def set_headroom(self, device: Any, headroom: int | None, source: str = HEADROOM_LIVE) -> None:
        """Keep ``headroom`` bytes free on ``device`` from the next budget query on, as ``source``.

        ``source`` is :data:`~membackend.platform.HEADROOM_LIVE` (``"live"``, or words starting with
        ``"live "``: a change while running, the memory panel's) or the start-up flags the value comes from
        (the ComfyUI adapter passes ``"comfyui --reserve-vram/--vram-headroom"``); :meth:`headroom_in_force`
        names it with these very words. Each level holds one value per device, and a live value wins (see
        the class docstring). ``headroom`` None takes that source's value away: the next source in the
        precedence applies again. Thread-safe.

        Raises ``InvalidSize`` (nothing changes) for a headroom that is not an int from 0 to the device's
        total bytes (the message gives the range), ``ConfigError`` for a ``source`` that is no text.
        """
        self._parts.headroom.set(device, headroom, source)

    # ------------------------------------------------------------------ optional members and hooks, close

    def page_size(self, device: Any) -> int:
        """The page size the backend maps on ``device``, in bytes: the ``page_size`` of every reservation made
        there (the backend's optional ``page_size_on(device)``, else its ``page_size``, else 2 MiB). A backend
        that fails raises its error, typed as every hook's (``PluginError`` for an untyped one)."""
        return self._parts.optional.page_size(device)

    def tensor_device(self, device: Any) -> str:
        """The torch device that reads the backend's memory on ``device``: ``cpu`` for host memory, or
        where the backend says its device memory is memory of this process the CPU addresses directly
        (its optional ``tensor_device(device)`` method); else ``cuda:N`` (torch's ROCm build calls HIP
        devices ``cuda`` too). A backend's answer that is not a torch device string is a ``PluginError``."""
        return self._parts.optional.tensor_device(device)

    def host_unregister(self, address: int) -> bool:
        """Ends a page-locking of host memory at ``address`` through the backend's optional
        ``host_unregister(address)`` (a GPU backend's driver); True when one started there. False where the
        backend has no such member (its devices read host memory as it is: nothing to unregister). A backend
        that fails raises its error, typed as every hook's (``PluginError`` for an untyped one)."""
        return self._parts.optional.host_unregister(address)

    def room_split(self, device: Any) -> Any:
        """Where the device's memory goes, as the backend measures it (``VmmBackend.room_split``: the room
        the headroom in force leaves, the process's other use, the weights' room, membackend's resident
        bytes), or None where the backend cannot say (``host``, ``aimdo``). The status shows it."""
        return self._parts.optional.room_split(device)

    def served(self) -> list[Device]:
        """Every device this session has reserved on."""
        return self.ledger.devices()

    def trim(self, device: Any = None) -> int:
        """Give back what the backend keeps for reuse (``membackend_trim``) on ``device``, or on every
        device this session served; returns the bytes given back (0 without the hook).

        Trimming several devices carries on past failures and then raises one
        ``PartialFailure`` naming each.
        """
        return self._parts.optional.trim(device)

    def inspect(self, device: Any) -> DriverState | None:
        """The driver's own view of ``device`` (``membackend_inspect``); None without the hook."""
        return self._parts.optional.inspect(device)

    def close(self) -> int:
        """Release every reservation still alive, trim every device served, then let the backend give back what
        it holds of the driver (``membackend_close``); returns how many reservations were released.

        Carries on past failures; if any, raises one ``PartialFailure`` naming
        each (what could be released and trimmed was). A recorded copy that
        failed and was never fenced is reported here (a ``fence(...)`` failure)
        and its reservation is still released: the failed copy counts as
        finished, so nothing keeps the range (G1).
        """
        parts = self._parts
        return close_session(self.name, parts.lifecycle.release_all(self.fence, parts.fencing.may_have_work),
                             self.trim, self._take_back_headroom, parts.bound.close,
                             self.tracer.close if self.tracer is not None else None)
