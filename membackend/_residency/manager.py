"""The residency manager: the policy's front, over the parts of this package (see its docstring)."""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, TypeVar

from ..types import Device, Fault, FenceToken, InvalidSize, ModelError, Reservation, ReservationReleased
from .content import Borrowed, Contents
from .eviction import Eviction
from .faulting import Faulting
from .holds import Hold
from .loads import LoadBook
from .model import Model, ModelKind, Unloaded, new_model
from .policy import ResidencyPolicy
from .registry import Registry
from .slots import Slot, as_int
from .unloading import Unloading
from .warm import WarmRange

if TYPE_CHECKING:  # annotations only: the tracer is the session's, residency never imports it
    from .._session import Session
    from .._trace import TraceObserver

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run ``method`` holding the manager's lock (see :class:`ResidencyManager` for why it is safe to)."""
    @functools.wraps(method)
    def call(self: "ResidencyManager", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


class ResidencyManager:
    """The membackend policy. ``tracer`` (default: the session's tracer) receives every decision.

    **Threads.** One manager may be called from several threads at once (ComfyUI's
    prompt worker faulting and unpinning, its server thread's ``/free`` calling
    :meth:`free_memory` or :meth:`unload_all`, copy threads calling
    :meth:`record`). Every method that reads or changes the policy's state
    (the registry, the page maps, pins, watermarks, priorities) holds one
    re-entrant lock, so each is atomic with respect to the others.

    The lock is held while the session fences (a full unload, a free waiting
    on recorded copies). That cannot deadlock with a copy thread: :meth:`record`
    takes no policy lock (it reads the slot's reservation once and lets the
    session order it against a racing release), so a copy thread never waits
    for the thread that waits for its copy. Releasing the lock around each fence
    instead would let another thread fault pages back in between the fence and
    the free, and the unload would free memory that new work just started on.

    **Failures.** A verb that raises leaves the page map agreeing with the
    session's ledger (pages it may have changed become UNKNOWN: evictable,
    freed by an unload). :meth:`full_unload`, :meth:`unload_all` and
    :meth:`unregister` carry on past failures and raise one
    :class:`~membackend.types.PartialFailure` naming every one.

    **Frees past the manager.** A caller that holds the session may free a
    model's pages straight through it. The session counts the frees of each
    reservation (``Session.backing_changes``); before the manager trusts a
    reservation's page map again -- a warm range, a fault, a hold, a tag, a
    borrow, its figures -- it takes in a count it did not follow: the pages
    become UNKNOWN (faulted again, with new generations, instead of answered
    from memory that went), their tags go, and a hold on them ends.

    **Parts.** A fault past its warm path (reserving again, keeping the headroom, evicting) is
    :class:`~.faulting.Faulting`; what to free and in which order is :class:`~.eviction.Eviction`; whole
    models leaving (unloads, and unloading idle models for address space) is :class:`~.unloading.Unloading`;
    content tags and the cache of dropped models are :class:`~.content.Contents`; the load records are a
    :class:`~.loads.LoadBook`. What they share -- the models, the run, the clock, the lock, the session, the
    policy, the tracer -- is one :class:`~.registry.Registry`; the manager composes them over it in its
    constructor, handing each the callables of the other parts it uses. No part holds the manager: what
    replaces one of its methods (on a subclass, on the instance) changes that public call only, never what
    the parts do. Every full unload runs the policy's hook (:meth:`ResidencyPolicy.full_unload_of`).
    """

    def __init__(self, session: Session, *, policy: ResidencyPolicy | None = None,
                 tracer: TraceObserver | None = None):
        self.session = session
        # the parts, composed here and only here: each gets the registry and the parts' callables it uses
        self._registry = reg = Registry(session, policy if policy is not None else ResidencyPolicy(),
                                        tracer if tracer is not None else session.tracer)
        self._lock = reg.lock  # the registry's lock, one look-up nearer for every verb (and _tensors takes it)
        self._loads = loads = LoadBook()
        self._eviction = eviction = Eviction(reg, loads)
        self._unloading = unloading = Unloading(reg, loads, eviction)
        self._contents = contents = Contents(reg, loads, eviction, unregister=unloading.unregister)
        unloading.sweep = contents.sweep  # each of the two calls the other: bound once both exist
        self._faulting = Faulting(reg, loads, evict=eviction.for_fault, reserve=unloading.reserve_making_room)
        #: bytes of dropped models kept as cache per device (:meth:`cache`): None, only as the budget allows;
        #: 0, none
        self.cache_limit: int | None = None

    @property
    def policy(self) -> ResidencyPolicy:
        """The decisions this manager leaves to its policy: the constructor's ``policy``, else a
        :class:`ResidencyPolicy` (membackend's own); its name is :attr:`policy_name`. Read-only: the parts
        hold the same object through the registry, so another policy is another manager."""
        return self._registry.policy

    @property
    def policy_name(self) -> str:
        """The name of :attr:`policy` (``policy.name``: ``membackend``, the lab's ``stock``), in every trace
        event and load record."""
        return self.policy.name

    @property
    def rules(self) -> ResidencyPolicy:
        """Deprecated: :attr:`policy`, the same object (``rules`` was its name while ``policy`` was its name's
        string); a ``DeprecationWarning`` at the caller's line, and ``rules`` goes in the next release."""
        import warnings

        warnings.warn("ResidencyManager.rules is deprecated: it is ResidencyManager.policy (the same "
                      "ResidencyPolicy; its name is policy_name); rules goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self.policy

    @property
    def tracer(self) -> TraceObserver | None:
        """What every decision is traced to (the constructor's ``tracer``, else the session's; None: nothing
        watches, and the warm paths run)."""
        return self._registry.tracer

    @tracer.setter
    def tracer(self, tracer: TraceObserver | None) -> None:
        self._registry.tracer = tracer

    @property
    def losses(self) -> dict[str, dict[str, Any]]:
        """Per model id, what it lost since its last load: ``{"time", "bytes", "reason", "for"}`` (see
        :meth:`loads_done`)."""
        return self._loads.losses

    @property
    def load_listeners(self) -> list[Callable[[dict[str, Any]], None]]:
        """Called with each finished load record (see :meth:`loads_done`); the ComfyUI adapter logs them."""
        return self._loads.listeners

    # ------------------------------------------------------------------ registry

    @_locked
    def register(self, model_id: str, size: int, devices: Any, kind: ModelKind | str = ModelKind.OTHER,
                 owner: Model | None = None) -> Model:
        """Register a model of ``size`` bytes on ``devices`` and reserve its address range on each.

        Every argument is checked before anything is reserved. When a reservation
        fails (a later device out of memory, a device that does not exist), the
        ones already made are released, nothing is registered, and the error is
        raised as it came.
        """
        if isinstance(model_id, str) and model_id in self._registry.models:
            raise ModelError(f"model {model_id!r} is already registered; unregister it or pick another id")
        model = new_model(model_id, size, devices, kind, owner)
        if owner is not None:
            self._registry.registered(owner, "owner")
        try:
            for slot in model.slots.values():
                self._unloading.reserve_making_room(slot)
        except BaseException as exc:
            self._unloading.roll_back(model, exc)
            raise
        if owner is not None:
            owner.owned.append(model)
        self._registry.models[model.id] = model
        self.policy.keep(self, model)
        self.trace("register", model, bytes=model.size, kind=model.kind.value,
                   devices=[str(d) for d in model.devices], owner=owner.id if owner is not None else None)
        return model

    @_locked
    def models(self) -> list[Model]:
        return list(self._registry.models.values())

    # ------------------------------------------------------------------ use

    @_locked
    def use(self, models: Iterable[Model], *, workflow: str | None = None) -> None:
        """Start a run (a workflow) that uses ``models``: they get the highest priority and may
        not be evicted whole; what else stays resident is decided by the budget (G4).
        ``workflow`` names the run in the trace (a replay's timeline marks the switch).
        Each model's load is recorded until the next ``use``, :meth:`on_idle` or :meth:`loads_done`."""
        models = [self._registry.registered(m) for m in models]
        self._contents.sweep()
        self.loads_done()
        self._registry.running = {m.id for m in models}
        for m in models:
            self._prioritize(m)
        self.trace("use", None, models=[m.id for m in models], workflow=workflow)
        self.policy.on_workflow_switch(self, models)
        for m in models:
            self._loads.begin(m, workflow, sum(s.resident_bytes() for s in m.slots.values()))

    @_locked
    def loads_done(self) -> list[dict[str, Any]]:
        """Close the loads the last :meth:`use` opened; returns one record per model, traced as a ``load`` event
        and handed to each of :attr:`load_listeners`.

        A record holds ``model``, ``size``, ``began`` (when the load began, epoch seconds), ``workflow``,
        ``resident_before`` and ``loaded`` (bytes its faults newly backed: each copied in), ``lost`` (what the
        model lost since its previous load: ``{"time", "bytes", "reason", "for"}``, ``for`` the ids of the
        models it made room for; None when it lost nothing), ``shed_during`` where its own pages were shed
        to fit the run, and ``kind``: ``kept`` (nothing loaded), ``reloaded`` (it had lost pages since its
        previous load) or ``cold`` (it loaded bytes with no loss recorded: a first load, or pages its own
        faults evicted to fit themselves). Listeners run under the policy's lock: they must not wait for
        another thread that may want it."""
        return self._loads.close(self.tracer, self.policy_name)

    @_locked
    def prioritize(self, model: Model) -> None:
        """Most recently used from now on; lifts the watermark of each of its reservations."""
        self._prioritize(model)
        self.trace("prioritize", model)

    def _prioritize(self, model: Model) -> None:
        self._registry.registered(model)
        model.last_used = next(self._registry.clock)
        for slot in model.slots.values():
            slot.watermark = None

    @_locked
    def keep_warm(self, device: Any, reason: str = "budget") -> int:
        """Evict whole models, least recently used first (never one the current run uses), until the
        budget's headroom is free again; returns bytes freed. ``reason`` is traced with each eviction."""
        freed = self._eviction.keep_warm(Device.parse(device), reason)
        if freed is None:  # the headroom is free
            return 0
        self._contents.sweep()
        return freed

    # ------------------------------------------------------------------ faults

    def _warm_range(self, model: Model, offset: Any, size: Any, device: Any) -> "tuple[Slot, Reservation] | None":
        """The slot and live reservation for the warm paths of :meth:`fault` and :meth:`unpin` (per weight per
        step): only an int range inside a registered model on a ``Device`` it has; None sends the caller down the
        checked path. The slot's page map has taken in every free made past the manager (``Registry.sync``)."""
        reg = self._registry
        slot = model.slots.get(device) if device.__class__ is Device else None
        if slot is None or (r := slot.reservation) is None or r.released or offset.__class__ is not int \
                or size.__class__ is not int or not 0 <= offset < offset + size <= model.size \
                or reg.models.get(model.id) is not model:
            return None
        if reg.frees.get(r.id, 0) != slot.frees:
            reg.unseen(slot, r)
        return slot, r

    @_locked
    def fault(self, model: Model, offset: int, size: int, device: Any = None) -> Fault:
        """Back ``[offset, offset+size)`` of ``model`` and pin it; evicts by priority when out of memory.

        The range must lie inside the model (``0 <= offset``, ``offset + size <= model.size``);
        a bad range is refused (``InvalidSize`` / ``OutOfRange``) before anything is evicted.
        A ``DriverError`` from the session leaves the pages it may have mapped counted
        (UNKNOWN, unpinned), so eviction and unload free them.
        """
        warm = self._warm_range(model, offset, size, device)
        if warm is not None:
            slot, r = warm
            # the warm path (per weight per step): every page resident, below any watermark -- pin and go
            ps = r.page_size
            first, last = offset // ps, (offset + size - 1) // ps + 1
            if slot.all_resident(first, last) and (slot.watermark is None or offset + size <= slot.watermark):
                model.last_used = next(self._registry.clock)
                f = self._faulting.session_fault(slot, r, offset, size, first, last)
                if f.ok:
                    return self._faulting.faulted(slot, offset, size, first, last, f)
        f = self._faulting.making_room(model, offset, size, device)
        self._contents.sweep()  # cached models its room emptied go (never inside the eviction's own loop)
        return f

    @_locked
    def warm_range(self, model: Model, offset: int, size: int, device: Any, fault: Fault) -> WarmRange | None:
        """A :class:`WarmRange` of ``[offset, offset+size)`` just faulted (``fault``, ok) on ``device``, for the
        next faults of the same range; None where the range is not all resident now or a tracer watches
        (every fault is traced then)."""
        warm = self._warm_range(model, offset, size, device)
        if warm is None or not fault.ok or self.tracer is not None:
            return None
        slot, r = warm
        ps = r.page_size
        if not slot.all_resident(offset // ps, (offset + size - 1) // ps + 1):
            return None
        return WarmRange(self._registry, model, slot, r, offset, size, fault)

    @_locked
    def hold(self, model: Model, offset: int, size: int, device: Any, on_end: Callable[[str], Any]) -> Hold | None:
        """Keep every page of ``[offset, offset+size)`` of ``model`` on ``device`` resident for a caller that
        reads them without faulting, until :meth:`Hold.end <.holds.Hold.end>`; ``on_end(reason)`` runs when
        the hold ends, before any of its pages can go (see :mod:`.holds` for when that is). None, and nothing
        held, when a page of the range is not resident now, the reservation is not alive, or the slot is held
        already. The range is checked as :meth:`fault` checks it."""
        slot = self._registry.slot(model, device)
        if not slot.alive or slot.hold is not None:
            return None
        offset, size, first, last = slot.pages(offset, size)
        self._registry.sync(slot)
        if not slot.all_resident(first, last):
            return None
        held = slot.hold = Hold(self._registry, slot, offset, size, on_end)
        self.trace("hold", model, device=str(slot.device), offset=offset, bytes=size)
        return held

    @_locked
    def unpin(self, model: Model, offset: int, size: int, device: Any = None) -> None:
        """The op that faulted the range is done with it; its pages may be evicted again."""
        warm = self._warm_range(model, offset, size, device) if self.tracer is None else None
        if warm is not None:  # the warm path, as in fault
            slot, r = warm
            ps = r.page_size
            slot.unpin(offset // ps, (offset + size - 1) // ps + 1)
            return
        slot = self._registry.slot(model, device)
        _, _, first, last = slot.pages(offset, size)
        if not slot.alive:
            return
        slot.unpin(first, last)
        if self.tracer is not None:
            self.trace("unpin", model, device=str(slot.device), offset=offset, bytes=size)

    def copied(self, model: Model, offset: int, size: int, seconds: float, device: Any = None) -> None:
        """Tell the trace that ``size`` bytes were copied into ``[offset, offset+size)`` of ``model``
        in ``seconds`` (the cast path's copy of fresh pages). Nothing else happens: a replay uses
        these to model load time and to run copies that a later free must wait for."""
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
                or seconds < 0:
            raise ModelError(f"copy seconds must be a finite number >= 0, got {seconds!r}")
        if self.tracer is not None:
            slot = self._registry.slot(model, device)
            self.trace("copy", model, device=str(slot.device), offset=as_int(offset, "offset"),
                       bytes=as_int(size, "copy size"), seconds=float(seconds))

    def record(self, model: Model, token: FenceToken, device: Any = None) -> None:
        """Asynchronous work (a copy) on the model's pages: frees and unloads wait for it.

        Takes no policy lock (see the class docstring): a copy thread must never
        wait for a thread that is fencing its copy. A full unload racing it either
        fences the token or makes this raise ``ReservationReleased``.
        """
        slot = self._registry.slot(model, device)
        r = slot.reservation  # read once: a racing full unload may release it under us
        if r is None or r.released:
            raise ReservationReleased(f"model {model.id!r} has no reservation on {slot.device} (fully unloaded); "
                                      "fault it before copying into it")
        try:
            self.session.record(r, token)
        except ReservationReleased:
            raise ReservationReleased(f"model {model.id!r} was fully unloaded from {slot.device} while the copy "
                                      "was recorded; fault it again and copy again") from None

    # ------------------------------------------------------------------ freeing and unloading

    @_locked
    def free_memory(self, amount: int, device: Any, reason: str = "free_memory") -> int:
        """Free at least ``amount`` bytes on ``device`` by priority (pinned pages stay); returns bytes freed.
        ``reason`` is what each model's next load record says it lost its pages for."""
        amount = as_int(amount, "amount")
        if amount < 0:
            raise InvalidSize(f"amount must be >= 0 bytes, got {amount}")
        device = Device.parse(device)
        freed = self._eviction.by_amount(amount, device, reason)
        self._contents.sweep()
        if freed < amount:
            log.info("membackend: free_memory(%d) on %s freed only %d bytes: the rest is pinned", amount, device, freed)
        self.trace("free_memory", None, device=str(device), bytes=amount, result=freed)
        return freed

    @_locked
    def full_unload(self, model: Model) -> int:
        """Fence, free every page, release the reservation on every device, and the same for what
        the model owns indirectly (G1, G5). Returns bytes that were resident. The model stays usable.

        A device that fails does not stop the others: everything that can be unloaded is,
        then one :class:`~membackend.types.PartialFailure` names each model and device that
        failed (those keep their reservation; unloading again retries them).

        Where the policy keeps reservations (``ResidencyPolicy.unload_keeps_reservation``), its pins and
        pages go (:meth:`drop_pages`) and the reservation and what the model owns stay.

        Runs the policy's hook (:meth:`ResidencyPolicy.full_unload_of`, ``via`` None), as every full unload
        does -- those :meth:`unload_all`, :meth:`unregister`, :meth:`full_unload_unless_pinned` and a reservation
        short of address space make too -- so wrapping or replacing the unloads is the policy's, never done by
        replacing this method: its callers alone would see that.
        """
        return self._unloading.full_unload(model, None)

    @_locked
    def drop_pages(self, model: Model, device: Any = None, *, unpin: bool = False) -> int | None:
        """Free every unpinned resident page of ``model`` on ``device`` (``unpin``: its pins go first, so every
        page) and keep its reservation; faults reaching the freed pages fail fast until the model is prioritized
        again. Returns the bytes freed; None when the reservation is not alive or nothing of it is resident."""
        return self._eviction.drop_pages(self._registry.slot(model, device), unpin=unpin)

    @_locked
    def full_unload_unless_pinned(self, model: Model) -> "Unloaded | None":
        """:meth:`full_unload`, unless a page of the model (or of what it owns) is pinned: then None, and
        nothing was done.

        The pin check and the unload are one decision under the policy's lock, so a
        fault on another thread either pins first (None here) or comes after the
        unload (and reserves anew, as any fresh fault). Raises what ``full_unload``
        raises (``PartialFailure``)."""
        return self._unloading.unless_pinned(self._registry.registered(model))

    @_locked
    def unload_all(self) -> int:
        """Full unload of every registered model (ComfyUI's ``unload_all_models``), then give back
        what the backend keeps for reuse (``Session.trim``), so the driver is back at its baseline (G1).

        Carries on past failures and raises one :class:`~membackend.types.PartialFailure`
        naming every model, device (and the trim) that failed. Returns bytes that were resident.
        """
        return self._unloading.everything()

    @_locked
    def on_idle(self) -> int:
        """The caller is idle (no run in progress, e.g. ComfyUI's prompt queue is empty): give back what
        the backend keeps for reuse — recycled physical handles, address windows kept against a
        reserve-churn limit — so held memory never outlives the work that needed it. Resident models
        stay resident (G4). Returns the bytes given back."""
        self.loads_done()
        self._registry.running = set()
        self._contents.sweep()
        given = self._unloading.trim()
        self.trace("idle", None, bytes=given)
        return given

    @_locked
    def unregister(self, model: Model) -> None:
        """Full unload, then forget the model (and what it owns).

        When the unload fails (``PartialFailure``), the model stays registered so
        that unregistering it again retries.
        """
        self._unloading.unregister(model, None)

    # ------------------------------------------------------------------ what pages hold, and the cache

    @_locked
    def tag(self, model: Model, offset: int, size: int, device: Any, key: Hashable) -> bool:
        """``[offset, offset+size)`` of ``model`` on ``device`` holds the bytes ``key`` names (the caller just
        wrote them); False, nothing tagged, unless every page of it is resident. The tag lasts as long as those
        pages keep their backing, or until :meth:`untag` (see :mod:`.content`)."""
        slot = self._registry.slot(model, device)
        offset, size, _, _ = slot.pages(offset, size)
        return self._contents.tag(slot, offset, size, key)

    @_locked
    def untag(self, model: Model, offset: int, size: int, device: Any = None) -> None:
        """Something else is about to be written into ``[offset, offset+size)``: what was known of it goes."""
        slot = self._registry.slot(model, device)
        offset, size, _, _ = slot.pages(offset, size)
        self._contents.untag(slot, offset, size)

    @_locked
    def borrow(self, device: Any, key: Hashable, avoid: tuple[Model, int, int] | None = None) -> Borrowed | None:
        """A resident range tagged ``key`` on ``device`` to copy from, pinned and viewed until
        :meth:`returned`; None when none holds those bytes. ``avoid``: the ``(model, offset, size)`` the copy
        writes into."""
        device = Device.parse(device)
        guard = None
        if avoid is not None:
            guard = (self._registry.slot(avoid[0], device), avoid[1], avoid[1] + avoid[2])
        return self._contents.borrow(device, key, guard)

    @_locked
    def returned(self, lent: Borrowed, moved: bool = True) -> int:
        """The copy from ``lent`` is done; where it came from the cache and ``moved``, those bytes belong to the
        reader now and the cached pages only they held are freed. Returns the bytes freed."""
        return self._contents.returned(lent, moved)

    @_locked
    def cache(self, model: Model) -> int:
        """``model``'s owner dropped it: keep its tagged pages as reclaimable cache, within :attr:`cache_limit`
        and the budget (the cache goes before any live model's page). Returns the bytes kept; 0 when nothing
        was (the model is left as it was: unregister it)."""
        return self._contents.cache(self._registry.registered(model), self.cache_limit)

    @_locked
    def cached(self, device: Any = None) -> int:
        """Bytes held as cache on ``device`` (every device: None)."""
        return self._contents.cached(Device.parse(device) if device is not None else None)

    @_locked
    def drop_cache(self, device: Any = None, amount: float = math.inf, reason: str = "cache dropped") -> int:
        """Release cached models on ``device`` (every device: None), least recently dropped first, until
        ``amount`` bytes went; returns the bytes freed."""
        return self._contents.drop(Device.parse(device) if device is not None else None, amount, reason)

    # ------------------------------------------------------------------ per-reservation controls
    # (what a comfy-aimdo ModelVBAR offers per reservation; the ComfyUI facade calls them)

    @_locked
    def deprioritize(self, model: Model) -> None:
        """Least recently used from now on: the model's pages are the first evicted."""
        self._registry.registered(model)
        model.last_used = 0
        self.trace("deprioritize", model)

    @_locked
    def shed(self, model: Model, amount: int, device: Any = None, floor: int = 0) -> int:
        """Free up to ``amount`` bytes of ``model``'s unpinned resident pages from the top down,
        never below byte ``floor``; returns bytes freed. The reservation stays (no watermark is set)."""
        slot = self._registry.slot(model, device)
        amount, floor = as_int(amount, "amount"), as_int(floor, "floor")
        if amount < 0 or floor < 0:
            raise InvalidSize(f"amount and floor must be >= 0 bytes, got {amount} and {floor}")
        if not slot.alive or not amount:
            return 0
        self._eviction.let_go(slot, "shed by its owner", for_others=False)
        low = -(-floor // slot.bound.page_size)  # pages wholly above the floor
        freed = self._eviction.shed(slot, amount, (slot, 0, low)) if low < slot.bound.pages else 0
        self.trace("shed", model, device=str(slot.device), bytes=amount, result=freed, floor=floor)
        self._loads.lost(model, freed, "shed by its owner")
        return freed

    @_locked
    def set_watermark(self, model: Model, limit: int | None, device: Any = None) -> None:
        """Faults reaching above byte ``limit`` fail fast until the model is prioritized (None: no limit)."""
        slot = self._registry.slot(model, device)
        slot.watermark = None if limit is None else as_int(limit, "watermark")
        self.trace("set_watermark", model, device=str(slot.device), limit=slot.watermark)

    @_locked
    def watermark(self, model: Model, device: Any = None) -> int | None:
        return self._registry.slot(model, device).watermark

    @_locked
    def residency(self, model: Model, device: Any = None) -> list[int]:
        """One entry per page of the model's reservation: bit 0 resident (or possibly resident),
        bit 1 pinned; empty when the reservation is not alive."""
        slot = self._registry.slot(model, device)
        if not slot.alive:
            return []
        self._registry.sync(slot)
        return [(1 if r else 0) | (2 if p else 0) for r, p in zip(slot.resident, slot.pins)]

    @_locked
    def pinned_and_evictable(self, model: Model, device: Any = None) -> tuple[int, int]:
        """Bytes of the model's pages on ``device`` that are pinned (a layer in use now) and that are resident
        (or possibly resident) and not pinned; ``(0, 0)`` when the reservation is not alive. The status's
        figures per model: the page map, as :meth:`residency` gives it, summed."""
        slot = self._registry.slot(model, device)
        if not slot.alive:
            return 0, 0
        pins, ps = slot.pins, slot.bound.page_size
        evictable = sum(1 for r, p in zip(slot.resident, pins) if r and not p)
        return (len(pins) - pins.count(0)) * ps, evictable * ps

    @_locked
    def evictable(self, device: Any) -> int:
        """Bytes of unpinned resident pages on ``device`` (what eviction could give back now)."""
        return self._eviction.evictable(Device.parse(device))

    # ------------------------------------------------------------------ reporting

    @_locked
    def stats(self, device: Any = None) -> dict[str, Any]:
        """Per model: resident bytes, whether its reservation is alive and whether a :meth:`hold` keeps its
        pages, on one device or all.

        Resident bytes equal the session ledger's for the model's reservations, failed
        verbs included (pages they may have changed are counted as the ledger counts them).
        """
        dev = Device.parse(device) if device is not None else None
        for m in self._registry.models.values():
            for s in m.slots.values():
                self._registry.sync(s)
        return {
            m.id: {
                "resident": sum(s.resident_bytes() for d, s in m.slots.items() if dev is None or d == dev),
                "reserved": any(s.alive for d, s in m.slots.items() if dev is None or d == dev),
                "held": any(s.hold is not None for d, s in m.slots.items() if dev is None or d == dev),
                "cached": m.cached,
            }
            for m in self._registry.models.values()
        }

    def trace(self, event: str, model: Model | None, **fields: Any) -> None:
        """Hand the tracer (where one watches) a decision: ``event`` with the policy's name, the model's id and
        ``fields`` (a policy's own decisions are traced through this too)."""
        self._registry.trace(event, model, **fields)
