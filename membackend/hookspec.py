"""The backend contract: pluggy hook specifications.

A backend is an object (usually a class instance) with a ``name`` attribute
(a lowercase identifier, unique among installed backends), ``device_kinds``
(the device kinds it serves: ``cpu``, ``cuda``, ``hip``), optional members
(:class:`OptionalMembers`: ``version``, ``capabilities``, ...), and one ``@hookimpl`` method for each hook in :data:`HOOKS`; the hooks in
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

The whole contract is this module: the hook specifications below (each with
its pre- and post-conditions, its errors and a short example), :class:`Backend`
(a ``typing.Protocol`` of what every backend has: check a class against it
with a type checker, ``backend: Backend = MyBackend()``, or at run time with
``isinstance(obj, Backend)``, which looks at the names only) and
:class:`OptionalHooks` (the four hooks a backend may add:
``membackend_trim``, ``membackend_inspect``, ``membackend_inject_failures``,
``membackend_close``) and :class:`OptionalMembers` (every other attribute or
method membackend reads when a backend has it: ``version``, ``capabilities``,
``own_headroom``, ``use_headroom``, ``tensor_device``, ``kept_windows``, ...,
each with its type, its meaning and what is used when it is missing). The
conformance kit (:mod:`membackend.testing`) checks what the types cannot: the
behaviour.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import pluggy

from .types import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverState,
    FailureInjection,
    Fault,
    FenceToken,
    Machine,
    Reservation,
)

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

#: the attributes and methods a backend may have besides the hooks (:class:`OptionalMembers` declares each); the
#: session reads those it uses once, when it is built (``session.members``: ``membackend._session.members``)
OPTIONAL_MEMBERS = ("version", "capabilities", "settings", "from_settings", "platform", "platform_values",
                    "page_size", "own_headroom", "use_headroom", "follow_headroom", "tensor_device", "room_split",
                    "kept_windows",
                    "fence_token", "host_unregister", "driver", "page_size_on", "descriptor_room")

__all__ = ["PROJECT", "hookspec", "hookimpl", "VERBS", "HOOKS", "OPTIONAL_HOOKS", "OPTIONAL_MEMBERS", "Backend",
           "OptionalHooks", "OptionalMembers", *HOOKS, *OPTIONAL_HOOKS]


@hookspec
def membackend_probe(machine: Machine) -> Candidate:
    """Say how well this backend fits ``machine``.

    Pre: none; must not create a GPU context or allocate memory.
    Post: a ``Candidate(name, score, reason, opt_in=False)`` on the
    :class:`~membackend.types.Score` scale; ``score == 0`` means the backend
    does not fit, and ``reason`` says why in words a user can act on.
    Errors: an exception here (or not answering within the ``probe_timeout``
    setting) marks the plugin broken; it is logged and skipped.

    Example::

        @hookimpl
        def membackend_probe(self, machine):
            if not any(d.device.kind == "cuda" for d in machine.devices):
                return Candidate(self.name, Score.NONE, "no CUDA device")
            return Candidate(self.name, 30, "a CUDA device; its own mechanism")
    """
    raise NotImplementedError  # a specification: pluggy never calls it


@hookspec(firstresult=True)
def membackend_reserve(device: Device, size: int) -> Reservation:
    """Reserve at least ``size`` bytes of address space on ``device``.

    Pre: ``size > 0``; ``device`` is one the backend serves.
    Post: a live ``Reservation`` whose ``size`` is ``size`` rounded up to whole
    pages; no physical memory is committed yet.
    Errors: ``WrongDevice`` for a device not served; ``DriverError`` when the
    address space cannot be reserved (nothing is left reserved).

    Example::

        @hookimpl
        def membackend_reserve(self, device, size):
            rounded = -(-size // self.page_size) * self.page_size
            base = self.driver.reserve(rounded)          # DriverError when refused
            return Reservation(device, base, rounded, self.page_size, self.name,
                               handle=PageTable(rounded // self.page_size), requested=size)
    """
    raise NotImplementedError  # a specification: pluggy never calls it


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

    Example::

        @hookimpl
        def membackend_fault(self, reservation, offset, size):
            pages = reservation.page_range(offset, size)
            missing = [i for i in pages if not reservation.handle.resident[i]]
            if not self.driver.map_all(reservation, missing):   # rolled back inside
                return Fault(False, (), pages.start, 0)
            gens = reservation.handle.new_generations(missing)
            return Fault(True, tuple(gens[pages.start:pages.stop]), pages.start,
                         len(missing) * reservation.page_size)
    """
    raise NotImplementedError  # a specification: pluggy never calls it


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

    Example::

        @hookimpl
        def membackend_free(self, reservation, offset, size):
            resident = [i for i in reservation.page_range(offset, size)
                        if reservation.handle.resident[i]]
            self.driver.unmap_all(reservation, resident)
            return len(resident) * reservation.page_size
    """
    raise NotImplementedError  # a specification: pluggy never calls it


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

    Example::

        @hookimpl
        def membackend_release_reservation(self, reservation):
            dropped = self.membackend_free(reservation, 0, reservation.size)
            self.driver.release(reservation.base, reservation.size)
            return dropped
    """
    raise NotImplementedError  # a specification: pluggy never calls it


@hookspec(firstresult=True)
def membackend_fence(device: Device, reservation: Reservation | None) -> None:
    """Wait until no asynchronous work the backend knows of touches the reservation.

    ``reservation`` None means the whole device. The session has already
    waited on the fence tokens recorded with it; a backend adds its own
    (stream or event synchronisation) or does nothing.
    Errors: ``DriverError``.

    Example::

        @hookimpl
        def membackend_fence(self, device, reservation):
            self.driver.synchronize(device)   # or nothing: the session waited for its tokens
    """
    raise NotImplementedError  # a specification: pluggy never calls it


@hookspec(firstresult=True)
def membackend_budget_query(device: Device) -> Budget:
    """Report ``device``'s memory from this platform's real source.

    Post: ``Budget(total, free, headroom, usable, source, unified)``;
    ``source`` names where the numbers came from (for the doctor).
    Errors: ``WrongDevice`` for a device not served; ``DriverError``.

    Example::

        @hookimpl
        def membackend_budget_query(self, device):
            total, free = self.driver.mem_get_info(device.index)
            return Budget.of(total, free, total // 20, "driver mem_get_info")
    """
    raise NotImplementedError  # a specification: pluggy never calls it


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

    Example::

        @hookimpl
        def membackend_trim(self, device):
            return sum(self.driver.release_handle(h) for h in self.kept.pop(device, []))
    """
    raise NotImplementedError  # a specification: pluggy never calls it


@hookspec(firstresult=True)
def membackend_close() -> None:
    """Optional. The session is closing: give back what the backend holds of the driver itself.

    Called once by ``Session.close()``, after every reservation was released and every
    device trimmed: a retained primary context (``cuDevicePrimaryCtxRelease``), a
    runtime handle. Using the backend afterwards may acquire them again.
    Errors: ``DriverError``; ``close()`` reports it with the other failures.

    Example::

        @hookimpl
        def membackend_close(self):
            if self.context is not None:
                self.driver.release_primary_context(self.context)
                self.context = None
    """
    raise NotImplementedError  # a specification: pluggy never calls it


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

    Example::

        @hookimpl
        def membackend_inspect(self, device):
            state = self.driver.allocation_table(device)   # the driver's, not the backend's, count
            return DriverState(reserved=state.reserved, resident=state.mapped,
                               held=state.unused_handles, source="driver allocation table")
    """
    raise NotImplementedError  # a specification: pluggy never calls it


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

    Example::

        @hookimpl
        def membackend_inject_failures(self, probability, seed):
            return self.driver.fail_randomly(probability, seed)   # has .injected and .stop()
    """
    raise NotImplementedError  # a specification: pluggy never calls it


# --------------------------------------------------------------------------- the protocols


@runtime_checkable
class Backend(Protocol):
    """What every backend has: the attributes the manager and the session read, and the seven required hooks.

    ``name``: lower case, unique among installed backends; ``device_kinds``: what it serves, of
    ``cpu``, ``cuda``, ``hip`` (both read only: a plain class attribute satisfies them). Every other
    member membackend reads is optional and declared in :class:`OptionalMembers`.
    Each method is decorated ``@hookimpl`` in the backend and keeps the argument names of its hook
    specification above (pluggy passes them by name). Check a class with a type checker::

        backend: Backend = MyBackend()

    ``isinstance(obj, Backend)`` checks that the names are there, not their signatures.
    """

    @property
    def name(self) -> str:
        """Lower case, unique among installed backends (``[a-z][a-z0-9_]*``)."""

    @property
    def device_kinds(self) -> tuple[str, ...]:
        """The device kinds it serves, of ``cpu``, ``cuda``, ``hip``."""

    def membackend_probe(self, machine: Machine) -> Candidate: ...

    def membackend_reserve(self, device: Device, size: int) -> Reservation: ...

    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault: ...

    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int: ...

    def membackend_release_reservation(self, reservation: Reservation) -> int: ...

    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None: ...

    def membackend_budget_query(self, device: Device) -> Budget: ...


@runtime_checkable
class OptionalHooks(Protocol):
    """The hooks a backend may add (:data:`OPTIONAL_HOOKS`), each used when present: ``trim`` (what is kept
    for reuse goes back), ``inspect`` (the driver's own view, for the kit), ``inject_failures`` (the
    platform's own failures at random, for the kit), ``close`` (what is held of the driver itself).
    A backend with all four satisfies ``Backend`` and this protocol; one with some of them is checked
    against their hook specifications by the kit."""

    def membackend_trim(self, device: Device) -> int: ...

    def membackend_inspect(self, device: Device) -> DriverState | None: ...

    def membackend_inject_failures(self, probability: float, seed: int) -> FailureInjection | None: ...

    def membackend_close(self) -> None: ...


class OptionalMembers(Protocol):
    """Every member besides the hooks that membackend reads from a backend when it is there (:data:`OPTIONAL_MEMBERS`).

    None is required: membackend reads each with ``getattr`` and uses the default said here when it is
    missing. A backend that has one must give it this type and meaning. The generic virtual-memory backend
    (a :class:`~membackend.platform.Platform` record's) has all of them but ``page_size`` (its page is per
    device: :meth:`page_size_on`); ``host`` and ``aimdo`` have
    ``version``, ``capabilities``, ``from_settings`` and ``own_headroom``.
    """

    #: shown by ``membackend backends`` and the doctor (missing: the distribution's version, else ``unknown``)
    version: str
    #: what the mechanism does and needs (missing: ``Capabilities()``); the kit and the session read it
    capabilities: Capabilities
    #: the settings the backend declares, read under its ``name`` from the same sources as membackend's own
    #: (``MEMBACKEND_<NAME>_<SETTING>``, ``[<name>]`` in ``membackend.toml``): ``membackend.platform.PlatformSetting``
    #: records (typed ``Any`` here: the contract sits below the platform layer and names no record above it);
    #: missing: none
    settings: tuple[Any, ...]
    #: the values of those settings (a ``PlatformValues``); missing: read from ``settings`` by the manager
    platform_values: Any
    #: the ``membackend.platform.Platform`` record the backend was built from (the VMM backend's); the kit's
    #: platform rules use it
    platform: Any
    #: the page size the backend maps, in bytes, where it is one for every device (missing: 2 MiB); read by
    #: ``Session.page_size`` where the backend has no :meth:`page_size_on`
    page_size: int
    #: the vendor driver the backend calls (a ``membackend._drivers`` driver); the kit queues real copies
    #: through it (``memcpy_htod_async``, with :meth:`fence_token`) where it has them, else timer tokens
    driver: Any

    @classmethod
    def from_settings(cls, settings: Any) -> Backend:
        """Build the backend from membackend's settings (an entry point naming a class; missing: the class is
        called with no arguments). A class that declares ``settings`` and takes ``values`` is called
        ``from_settings(settings, values=...)`` with their values."""
        ...

    def own_headroom(self, device: Device, total: int) -> tuple[int, str]:
        """The headroom the backend's own rule keeps free on ``device`` of ``total`` bytes, and where it comes
        from in words (``platform cuda_wddm's own rule``). The lowest level of ``Session.headroom_in_force``;
        missing: the ``headroom`` of the backend's ``Budget``."""
        ...

    def use_headroom(self, headrooms: Any, instead_of: Any = None) -> None:
        """From now on read the headroom in force on a device from ``headrooms[device]`` (a mapping of
        :class:`membackend.platform.Headroom`, one per device: ``headrooms[device].in_force(total)[0]`` is the
        bytes), for the budget and any decision the mechanism takes on the headroom (a unified pool refusing a
        fault up front); None: back to :meth:`own_headroom`. With ``instead_of``, only while that mapping is
        the one used. The session calls it when it is built and when it closes (the latest session built is
        followed), so the budget the backend reports keeps the headroom the session decided, and a budget
        query computes it once, downward; read only together with :meth:`own_headroom`. Missing: the session
        applies its headroom to the backend's budget itself."""
        ...

    def follow_headroom(self, decide: Callable[[Device, int], int] | None,
                        instead_of: Callable[[Device, int], int] | None = None) -> None:
        """Deprecated, accepted for one release more: the older form of :meth:`use_headroom`, handed
        ``decide(device, total) -> bytes`` (a function reading the session's ``Headroom``) instead of the
        mapping; None, with ``instead_of``, when the session closes. A backend with both is handed the mapping
        only. Read only together with :meth:`own_headroom`."""
        ...

    def tensor_device(self, device: Device) -> str:
        """The torch device that reads the backend's memory on ``device``: ``cpu`` where it is memory of this
        process the CPU addresses directly, else ``cuda:N`` (missing: ``cpu`` for cpu devices, ``cuda:N``
        otherwise). Anything else is a ``PluginError`` (``Session.tensor_device``)."""
        ...

    def room_split(self, device: Device) -> Any:
        """Where ``device``'s memory goes under the headroom in force, in bytes (the VMM backend's
        ``RoomSplit``: ``total``, ``free``, ``headroom``, ``room``, ``held``, ``other``, ``weights_room``,
        ``resident``, ``source``); the ComfyUI status shows it. Missing: the status shows no split."""
        ...

    def kept_windows(self, device: Device) -> Any:
        """What stays reserved on ``device`` after its reservations were released under a reserve-churn limit
        (the VMM backend's ``KeptWindows``: a dataclass with ``describe()``), or None where nothing is kept;
        the doctor and the ComfyUI status show it. Missing: nothing is kept."""
        ...

    def descriptor_room(self, device: Device) -> Any:
        """What ``device`` can map under the process's file-descriptor limit where each live handle holds a
        descriptor (the VMM backend's ``DescriptorRoom``: ``limit``, ``hard``, ``open``, ``handles``,
        ``page_size``, ``started``, with ``free``, ``mappable`` and ``describe(budget)``), or None where handles
        hold none or the device was not used yet; the doctor shows it. Missing: no descriptor line."""
        ...

    def fence_token(self, reservation: Reservation, stream: Any) -> FenceToken:
        """A token for the work queued on ``stream`` that touches ``reservation`` (an event recorded after it),
        for ``Session.record``; the kit fences against real device work with it. Missing: the kit's async
        checks use timer tokens and say so."""
        ...

    def host_unregister(self, address: int) -> bool:
        """End the page-locking with the vendor's driver of the host range registered at ``address`` (as torch's
        ``cudaHostRegister`` makes one): True when one started there, False when none did. Called before that
        memory is unmapped (``Session.host_unregister``). Missing: False (the backend's devices read host
        memory as it is)."""
        ...

    def page_size_on(self, device: Device) -> int:
        """The page size the backend maps on ``device``, in bytes: the ``page_size`` of every reservation it
        makes there (the VMM backend's: its page rounded up to the device's mapping granularity). Read by
        ``Session.page_size``, by which the ComfyUI adapter sizes a model without a live reservation.
        Missing: :attr:`page_size`."""
        ...
