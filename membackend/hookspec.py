"""The backend contract: pluggy hook specifications.

A backend is an object (usually a class instance) with a ``name`` attribute
(a lowercase identifier, unique among installed backends), ``device_kinds``
(the device kinds it serves: ``cpu``, ``cuda``, ``hip``), an optional
``version`` and ``capabilities`` (:class:`membackend.types.Capabilities`),
and one ``@hookimpl`` method for each hook in :data:`HOOKS`; the hooks in
:data:`OPTIONAL_HOOKS` (``trim``, ``inspect``, ``inject_failures``, ``close``)
may be added. Third parties publish it under the entry-point group
``membackend.backends``::

    [project.entry-points."membackend.backends"]
    mybackend = "my_package.backend:MyBackend"

An entry point may name an instance, a class (built with its
``from_settings(settings)`` classmethod when it has one, else with no
arguments) or a :class:`membackend.platform.Platform` record (built into the
virtual-memory backend, named after the platform).

``membackend_probe`` scores on one scale (:class:`membackend.types.Score`):
0 does not fit; the built-in ``host`` is 1; generic GPU backends 10–49;
platform plugins 50–99, a more specific fit higher. ``Candidate(...,
opt_in=True)`` fits but is selected only when forced by name. A third-party
backend should take 30 when it serves any device of a vendor with its own
mechanism (above the built-in ``aimdo`` 10 and ``vmm`` 20, below every platform
plugin), 60 as a platform plugin (higher only for a more specific fit).

Every verb except ``membackend_probe`` is called on the selected backend only,
through a :class:`membackend._session.Session`. The session has already checked
the arguments (device served, reservation alive and owned by this session,
sizes positive, ranges inside the reservation, free ranges page aligned), so a
backend only implements the mechanism. A session may be shared by several
threads; it serialises calls on one reservation, so a backend must only be
safe for calls on different reservations at once. Observers (tracers,
telemetry) add ``wrapper=True`` hookimpls of the same names; any other
observer hookimpl is refused.

All sizes are bytes; offsets are relative to the reservation's base.
"""

from __future__ import annotations

import pluggy

from .types import Budget, Candidate, Device, DriverState, FailureInjection, Fault, Machine, Reservation

PROJECT = "membackend"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: the six verbs a backend must implement, besides ``membackend_probe``
VERBS = (
    "membackend_reserve",
    "membackend_fault",
    "membackend_free",
    "membackend_release_reservation",
    "membackend_fence",
    "membackend_budget_query",
)
#: every hook a backend must implement
HOOKS = ("membackend_probe",) + VERBS
#: hooks a backend may implement; the session and the conformance kit use them when present
OPTIONAL_HOOKS = ("membackend_trim", "membackend_inspect", "membackend_inject_failures", "membackend_close")


@hookspec
def membackend_probe(machine: Machine) -> Candidate:
    """Say how well this backend fits ``machine``.

    Pre: none; must not create a GPU context or allocate memory.
    Post: a ``Candidate(name, score, reason, opt_in=False)`` on the
    :class:`~membackend.types.Score` scale; ``score == 0`` means the backend
    does not fit, and ``reason`` says why in words a user can act on.
    Errors: an exception here (or not answering within the ``probe_timeout``
    setting) marks the plugin broken; it is logged and skipped.
    """


@hookspec(firstresult=True)
def membackend_reserve(device: Device, size: int) -> Reservation:
    """Reserve at least ``size`` bytes of address space on ``device``.

    Pre: ``size > 0``; ``device`` is one the backend serves.
    Post: a live ``Reservation`` whose ``size`` is ``size`` rounded up to whole
    pages; no physical memory is committed yet.
    Errors: ``WrongDevice`` for a device not served; ``DriverError`` when the
    address space cannot be reserved (nothing is left reserved).
    """


@hookspec(firstresult=True)
def membackend_fault(reservation: Reservation, offset: int, size: int) -> Fault:
    """Back every page the byte range ``[offset, offset+size)`` touches.

    Pre: the reservation is alive; the range lies inside it.
    Post: ``Fault(ok=True, generations, first_page, mapped)`` with one
    generation per page of the range; a page's generation changes whenever it
    gets new physical memory. Out of memory is ``Fault(ok=False)``, not an
    exception, and the pages this call mapped are rolled back.
    Errors: ``DriverError`` for failures other than out-of-memory, after rollback;
    pages the rollback could not unmap stay resident, and their bytes go on the
    error as ``mapped`` so the session's ledger counts them.
    """


@hookspec(firstresult=True)
def membackend_free(reservation: Reservation, offset: int, size: int) -> int:
    """Drop the resident pages of ``[offset, offset+size)``, keeping the address range.

    Pre: alive; range inside the reservation and page aligned (its end may be
    the reservation's end); the session has fenced the reservation.
    Post: returns the number of bytes that were resident and are now dropped
    (0 when nothing was resident); those pages get new generations when faulted again.
    Errors: ``DriverError``. A free that fails part-way must leave: the
    reservation alive with its whole address range; every page it dropped
    dropped (its memory given back or kept for reuse, a new generation when
    faulted again); every page it did not reach resident with its contents and
    generation unchanged; and the bytes it dropped on the error as
    ``dropped`` (0 when none), so the session's ledger keeps matching the
    driver. A free is not rolled back (a dropped page is not backed again);
    the caller may free again, and the retry drops what is left.
    """


@hookspec(firstresult=True)
def membackend_release_reservation(reservation: Reservation) -> int:
    """Drop every page and return the address range.

    Pre: alive; the session has fenced the reservation.
    Post: returns the bytes that were resident; the address range is returned
    to the platform. The session then marks the reservation released.
    Errors: ``DriverError``; the backend frees what it can before raising and
    puts the bytes it dropped on the error as ``dropped``. The reservation then
    stays alive (the session does not mark it released), holding what could not
    be given back, so a later release (or ``Session.close``) tries again.
    """


@hookspec(firstresult=True)
def membackend_fence(device: Device, reservation: Reservation | None) -> None:
    """Wait until no asynchronous work the backend knows of touches the reservation.

    ``reservation`` None means the whole device. The session has already
    waited on the fence tokens recorded with it; a backend adds its own
    (stream or event synchronisation) or does nothing.
    Errors: ``DriverError``.
    """


@hookspec(firstresult=True)
def membackend_budget_query(device: Device) -> Budget:
    """Report ``device``'s memory from this platform's real source.

    Post: ``Budget(total, free, headroom, usable, source, unified)``;
    ``source`` names where the numbers came from (for the doctor).
    Errors: ``WrongDevice`` for a device not served; ``DriverError``.
    """


# --------------------------------------------------------------------------- optional hooks


@hookspec(firstresult=True)
def membackend_trim(device: Device) -> int:
    """Optional. Give back to the platform what the backend keeps for reuse on ``device``.

    Physical handles kept for recycling, address windows pooled against a
    reserve-churn limit: anything held that no live reservation uses. The
    session calls it on ``close()`` and after a full unload of everything, so
    the driver returns to its baseline (G1).
    Post: returns the bytes given back; ``membackend_inspect`` then reports ``held == 0``, except what the
    platform does not let the backend give back (a reserve-churn limit whose frees are spent: those windows
    stay, bounded, and ``inspect`` reports them as held).
    Errors: ``DriverError``; what could not be given back stays held (and is tried again next time).
    """


@hookspec(firstresult=True)
def membackend_close() -> None:
    """Optional. The session is closing: give back what the backend holds of the driver itself.

    Called once by ``Session.close()``, after every reservation was released and every
    device trimmed: a retained primary context (``cuDevicePrimaryCtxRelease``), a
    runtime handle. Using the backend afterwards may acquire them again.
    Errors: ``DriverError``; ``close()`` reports it with the other failures.
    """


@hookspec(firstresult=True)
def membackend_inspect(device: Device) -> DriverState | None:
    """Optional. The driver's own view of ``device``, for the conformance kit.

    Ask the platform (the driver's allocation tables, the kernel), not the
    backend's bookkeeping: the kit compares the answer with the session's
    ledger after every step, so a backend that only counts what it meant to do
    proves nothing. Return None when the driver cannot be asked right now.
    Backends serving ``cpu`` devices with process addresses need not implement
    it: the kit checks those against the kernel itself (``/proc/self/maps``,
    ``mincore``). A GPU backend without it gets a kit summary that names the
    checks it could not run.
    """


@hookspec(firstresult=True)
def membackend_inject_failures(probability: float, seed: int) -> FailureInjection | None:
    """Optional. From now on, fail driver calls at random, as the platform can.

    ``probability`` is the chance that each driver call fails; ``seed`` makes
    the sequence repeatable. Failures must look exactly like the platform's
    own (an out-of-memory code, an invalid-value code), so the backend's real
    error paths run. Returns a :class:`~membackend.types.FailureInjection`
    whose ``stop()`` ends it, or None when this backend cannot inject. The
    conformance kit uses it to prove rollback and accounting under failure; a
    backend without it gets a summary that names the checks skipped.
    """
