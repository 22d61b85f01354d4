"""The residency policy: which model pages stay resident, which are evicted, when a reservation goes back.

Backends are mechanism (a fault with no room is ``Fault(ok=False)``); this
module is policy, on top of a :class:`~membackend._session.Session`:

* **Models and reservations.** :meth:`ResidencyManager.register` gives a model
  one reservation per device. Priority follows use (most recently used
  highest) and, inside one reservation, lower offsets before higher, as
  comfy-aimdo orders its VBAR pages. A fault pins its pages until
  :meth:`~ResidencyManager.unpin`; pinned pages are never evicted. A
  reservation that lost pages to another model's fault gets a watermark:
  faults above it fail fast until the model is used again.
* **Eviction on pressure.** Before backing new pages the budget's headroom is
  kept free (for activations); when a fault is out of memory, unpinned pages of
  the lowest-priority reservations are freed, top down, until it fits, then it
  is retried; with nothing left to evict the out-of-memory result reaches the
  caller. The faulting model never gives up its own pages for its faults: a
  model larger than its room keeps what it has resident and the caller
  streams the rest, with no page mapped and unmapped again on every step. Pages a live tensor from :mod:`membackend._tensors` views are skipped
  as pinned ones are (the session would refuse their free with ``TensorAlive``),
  and a full unload of a model with such a tensor is refused the same way.
* **Full unload** (G1, G5): fence, free every page, release the reservation
  (when the backend's capabilities say so, the default) and do the same for
  what the model owns indirectly (Hook delegates, cast buffers) and its pins.
  The model object stays usable: its next fault reserves again and reports new
  generations, so the caller copies again. Unloading everything also trims the
  session (recycled handles, kept windows), so the driver is back at its
  baseline. Unloads carry on past failures and raise one ``PartialFailure``.
* **Threads and failures**: see :class:`ResidencyManager` and the residency
  section of ``docs/architecture.md``.
* **Keep warm by budget** (G4): a workflow switch (:meth:`~ResidencyManager.use`)
  keeps other models resident while the budget allows; when it does not,
  whole models are evicted least recently used first, never one the current
  run uses.

The decisions a variant of the policy may change are one small public object,
:class:`ResidencyPolicy`, that the manager takes (``ResidencyManager(session,
policy=...)``): how the registry holds models, what a workflow switch does, the
fence before a free, whether whole models are evicted, whether only a release
gives memory back (ROCm 7.2), whether a fault may shed the model's own pages, and
whether a full unload keeps the reservation. Today's ComfyUI + comfy-aimdo
behaviour, reproduced for side-by-side comparison, is such a policy in the lab
(``membackend.lab._replay.stock``): policy code here stays free of comparison models.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import threading
import time
import weakref
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Iterable, MutableMapping, TypeVar

from ._hostmem import process_private_bytes
from .types import (
    Device,
    DriverError,
    Fault,
    FenceToken,
    InvalidSize,
    ModelError,
    OutOfRange,
    PartialFailure,
    Reservation,
    ReservationReleased,
    TensorAlive,
    WrongDevice,
)

if TYPE_CHECKING:  # annotations only: the tracer is the session's, residency never imports it
    from ._session import Session
    from ._trace import TraceObserver

log = logging.getLogger(__name__)

__all__ = ["ModelKind", "Model", "ModelError", "ResidencyManager", "ResidencyPolicy", "Unloaded", "WarmRange"]

# what the policy's page map says about one page
GONE, RESIDENT, UNKNOWN = 0, 1, 2  # UNKNOWN: a driver call on it failed part-way; it may be resident

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run ``method`` holding the manager's lock (see :class:`ResidencyManager` for why it is safe to)."""
    @functools.wraps(method)
    def call(self: "ResidencyManager", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


def _as_int(value: Any, what: str) -> int:
    if value.__class__ is int:
        return value
    from ._settings import quoted

    if isinstance(value, bool):
        raise InvalidSize(f"{what} must be an integer number of bytes, got {value!r}; accepted: an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidSize(f"{what} must be an integer number of bytes, got {quoted(value)}") from None


def _changed(exc: BaseException) -> tuple[int, int]:
    """Bytes a failed verb still mapped and dropped, exactly as the session's ledger takes them."""
    if isinstance(exc, DriverError):
        return getattr(exc, "mapped", 0) or 0, getattr(exc, "dropped", 0) or 0
    return 0, 0


class ModelKind(str, Enum):
    DIFFUSION = "diffusion"
    TEXT_ENCODER = "text_encoder"
    VAE = "vae"
    HOOK_DELEGATE = "hook_delegate"
    CAST_BUFFER = "cast_buffer"
    OTHER = "other"


class _Slot:
    """A model's reservation on one device, with the policy's page map.

    ``resident[p]`` is GONE, RESIDENT or UNKNOWN. A page is UNKNOWN after a
    fault or free over it raised: the driver may have left it mapped (a
    rollback that could not unmap) or dropped it (a free that stopped half
    way). ``maybe`` is how many bytes of the UNKNOWN pages are resident, as the
    ledger counts them (``DriverError.mapped`` / ``.dropped``), so the slot's
    resident bytes always equal the ledger's for the reservation. UNKNOWN pages
    count as resident for eviction and unload (they are freed, and the free
    says how much went) and as missing for faults (they are backed again).
    """

    __slots__ = ("model", "device", "reservation", "resident", "maybe", "pins", "watermark", "kept", "epoch")

    def __init__(self, model: "Model", device: Device):
        self.model = weakref.proxy(model)  # a stock finalizer holds slots; they must not keep the model alive
        self.device = device
        self.reservation: Reservation | None = None
        self.resident = bytearray()
        self.maybe = 0
        self.pins = array("H")
        self.watermark: int | None = None  # faults reaching above fail fast; None: no limit
        # bytes of pages freed whose memory stays with the reservation, for its own next faults (where memory
        # returns only when the range is freed: ``memory_returns_on_unmap`` false); 0 elsewhere
        self.kept = 0
        #: counts every change that may take a page's backing or generation (a free, a failure, a release,
        #: a new reservation): a :class:`WarmRange` made at one count holds until the next
        self.epoch = 0

    def bind(self, r: Reservation) -> None:
        self.epoch += 1
        self.reservation = r
        self.resident = bytearray(r.pages)
        self.maybe = 0
        self.pins = array("H", bytes(2 * r.pages))
        self.watermark = None
        self.kept = 0

    def clear_pins(self) -> None:
        self.pins = array("H", bytes(2 * len(self.pins)))

    @property
    def alive(self) -> bool:
        return self.reservation is not None and not self.reservation.released

    @property
    def bound(self) -> Reservation:
        """The reservation of a slot that was bound: every verb of the policy runs on a bound slot."""
        r = self.reservation
        assert r is not None, "a slot is bound to its reservation before the policy works on it"
        return r

    def resident_bytes(self) -> int:
        return self.resident.count(RESIDENT) * self.bound.page_size + self.maybe if self.alive else 0

    def missing(self, first: int, last: int) -> int:
        """Bytes of ``[first, last)`` not known to be resident (UNKNOWN pages included)."""
        return (last - first - self.resident.count(RESIDENT, first, last)) * self.bound.page_size

    # the map follows every verb's outcome exactly as the ledger does

    def faulted(self, first: int, last: int, mapped: int) -> None:
        """A fault of pages ``[first, last)`` succeeded and newly backed ``mapped`` bytes."""
        unknown = self.resident.count(UNKNOWN, first, last)
        if unknown:  # what was not newly backed among the not-known pages was resident already
            self.maybe -= self.missing(first, last) - mapped
        self.resident[first:last] = b"\x01" * (last - first)
        self._settle()

    def freed(self, first: int, last: int, dropped: int) -> None:
        """A free of pages ``[first, last)`` succeeded and dropped ``dropped`` bytes."""
        self.epoch += 1
        if self.resident.count(UNKNOWN, first, last):
            self.maybe -= dropped - self.resident.count(RESIDENT, first, last) * self.bound.page_size
        self.resident[first:last] = bytes(last - first)
        self._settle()

    def fault_failed(self, first: int, last: int, exc: BaseException) -> None:
        """A fault of ``[first, last)`` raised: its pages not known resident may be mapped now (unpinned)."""
        self.epoch += 1
        mapped, dropped = _changed(exc)
        r = self.resident
        for p in range(first, last):
            if r[p] == GONE:
                r[p] = UNKNOWN
        self.maybe += mapped - dropped

    def free_failed(self, first: int, last: int, exc: BaseException) -> None:
        """A free (or release) of ``[first, last)`` raised: its resident pages may or may not be gone."""
        self.epoch += 1
        mapped, dropped = _changed(exc)
        r = self.resident
        known = r.count(RESIDENT, first, last)
        for p in range(first, last):
            if r[p] == RESIDENT:
                r[p] = UNKNOWN
        self.maybe += known * self.bound.page_size + mapped - dropped

    def _settle(self) -> None:
        # only a backend whose results disagree with its own errors can trip these; keep the map sane
        if UNKNOWN not in self.resident and self.maybe:
            log.warning("membackend: model %s on %s: %d resident byte(s) unaccounted once every page was settled",
                        self.model.id, self.device, self.maybe)
            self.maybe = 0
        elif self.maybe < 0:
            self.maybe = 0

    def released(self) -> None:
        self.epoch += 1
        self.resident = bytearray(len(self.resident))
        self.maybe = 0
        self.kept = 0


class WarmRange:
    """A range of one model's reservation that a fault backed and pinned: while nothing of that reservation
    was freed, failed or released since (its slot's ``epoch``), :meth:`pin` pins it again and answers the
    same :class:`Fault` (the same generations: nothing to copy again) with no session call, and
    :meth:`unpin` unpins it. Made by :meth:`ResidencyManager.warm_range`; the per-weight, per-step path of a
    caller that faults the same ranges over and over (ComfyUI's sampler)."""

    __slots__ = ("_manager", "_model", "_slot", "_reservation", "_first", "_last", "_end", "_epoch", "fault")

    def __init__(self, manager: "ResidencyManager", model: "Model", slot: _Slot, r: Reservation, offset: int,
                 size: int, fault: Fault):
        ps = r.page_size
        self._manager, self._model, self._slot, self._reservation = manager, model, slot, r
        self._first, self._last, self._end = offset // ps, (offset + size - 1) // ps + 1, offset + size
        self._epoch = slot.epoch
        self.fault = fault

    def pin(self) -> Fault | None:
        """Pin the range again and answer its fault; None when it may have changed (the caller faults it)."""
        m = self._manager
        with m._lock:
            slot, r = self._slot, self._reservation
            if slot.epoch != self._epoch or slot.reservation is not r or r.released or m.tracer is not None \
                    or (slot.watermark is not None and self._end > slot.watermark) \
                    or m._models.get(self._model.id) is not self._model:
                return None
            pins = slot.pins
            for p in range(self._first, self._last):
                pins[p] += 1
            self._model.last_used = next(m._clock)
            return self.fault

    def unpin(self) -> bool:
        """Unpin the range; False when its reservation is not the one it was made on (the caller unpins)."""
        m = self._manager
        with m._lock:
            slot = self._slot
            if slot.reservation is not self._reservation or m.tracer is not None:
                return False
            pins = slot.pins
            for p in range(self._first, self._last):
                if pins[p]:
                    pins[p] -= 1
            return True


@dataclass(eq=False)
class Model:
    """A registered model. Callers keep it; the manager keeps what it needs to know about it."""

    id: str
    size: int
    devices: tuple[Device, ...]
    kind: ModelKind = ModelKind.OTHER
    owner: "Model | None" = None
    owned: list["Model"] = field(default_factory=list, repr=False)
    last_used: int = 0
    slots: dict[Device, _Slot] = field(default_factory=dict, repr=False)
    __weakref__: Any = field(default=None, init=False, repr=False, compare=False)

    def reservation(self, device: Device | str | None = None) -> Reservation | None:
        slot = self.slots[device if device.__class__ is Device else
                          Device.parse(device) if device is not None else self.devices[0]]
        r = slot.reservation
        return r if r is not None and not r.released else None


class ResidencyPolicy:
    """The decisions a :class:`ResidencyManager` leaves to its policy: membackend's by default.

    Subclass it and override what differs (the stock comfy-aimdo model in ``membackend.lab`` is one); the
    manager calls each member under its lock, so a member may call the manager's public methods, never wait
    for another thread. The flags:

    * ``name``: what the trace and the load records call the policy;
    * ``sheds_own_pages_for_a_fault``: a fault out of room may take the faulting model's own unpinned pages
      (aimdo: from its top page down). membackend: never -- a model larger than its room keeps what it has
      resident and the rest streams, step after step, where giving up the pages it used a moment ago maps
      and unmaps every page past what stays on every step (the churn under a cap: 1.7 GiB per prompt of 4
      steps for a 2.2 GiB UNet in 0.9 GiB of room, ``bench_comfyui_gpu.py --standin``);
    * ``evicts_whole_models``: a fault out of room, and :meth:`ResidencyManager.keep_warm`, may evict whole
      models outside the current run before any page of the run's;
    * ``unload_keeps_reservation``: a full unload drops the pages and keeps the reservation and what the model
      owns (today's aimdo: the ``ModelVBAR`` lives as long as its model object) instead of releasing them (G1).
    """

    name = "membackend"
    sheds_own_pages_for_a_fault = False
    evicts_whole_models = True
    unload_keeps_reservation = False

    def registry(self) -> MutableMapping[str, "Model"]:
        """The mapping the manager registers models in (a plain dict holds them as long as they are registered)."""
        return {}

    def keep(self, manager: "ResidencyManager", model: "Model") -> None:
        """``model`` was just registered (and is in the registry)."""

    def on_workflow_switch(self, manager: "ResidencyManager", models: list["Model"]) -> None:
        """A run that uses ``models`` starts (:meth:`ResidencyManager.use`): membackend keeps the others
        resident while the budget allows (G4), evicting whole models, least recently used first, past it."""
        for device in {d for m in manager.models() for d in m.devices}:
            manager.keep_warm(device)

    def fence_before_free(self, session: "Session", device: Device, during_fault: bool) -> None:
        """Before the manager frees pages on ``device`` (``during_fault``: to make room for a fault). The
        session already fences the reservation's recorded work before every free (G2): nothing to add."""

    def frees_by_release(self, session: "Session") -> bool:
        """Whether only releasing a reservation returns memory to the driver (``memory_returns_on_unmap`` false:
        ROCm 7.2); freeing pages then helps only their own reservation, which maps them again."""
        return not session.capabilities.memory_returns_on_unmap


@dataclass(frozen=True)
class Unloaded:
    """What one full unload did: ``bytes`` that were resident, the reservations that were ``alive`` before,
    how many were ``released`` (0 where the platform keeps address ranges), and their ``reserved_bytes``."""

    bytes: int
    alive: int
    released: int
    reserved_bytes: int


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
    """

    #: the policy's name (``rules.name``), in every trace event and load record
    policy = "membackend"

    def __init__(self, session: Session, *, policy: ResidencyPolicy | None = None,
                 tracer: TraceObserver | None = None):
        self.session = session
        #: the decisions this manager leaves to its policy (:class:`ResidencyPolicy`)
        self.rules = policy if policy is not None else ResidencyPolicy()
        self.policy = self.rules.name
        self.tracer = tracer if tracer is not None else getattr(session, "tracer", None)
        self._models: MutableMapping[str, Model] = self.rules.registry()
        self._in_fault = False  # a fault is making room: what the policy's fence before a free is told
        self._clock = itertools.count(1)
        self._running: set[str] = set()  # ids of the models the current run uses
        self._lock = threading.RLock()  # re-entrant: full_unload recurses, fault evicts through _shed
        #: per model id, what it lost since its last load: {"time", "bytes", "reason", "for"} (see loads_done)
        self.losses: dict[str, dict[str, Any]] = {}
        self._loads: dict[str, dict[str, Any]] = {}  # the loads of the current use(), by model id
        #: called with each finished load record (see :meth:`loads_done`); the ComfyUI adapter logs them
        self.load_listeners: list[Callable[[dict[str, Any]], None]] = []

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
        if not isinstance(model_id, str) or not model_id:
            raise ModelError(f"a model id is a non-empty str, got {model_id!r}")
        if model_id in self._models:
            raise ModelError(f"model {model_id!r} is already registered; unregister it or pick another id")
        size = _as_int(size, "model size")
        if size <= 0:
            raise InvalidSize(f"model size must be > 0 bytes, got {size}")
        devs = tuple(Device.parse(d) for d in (devices if isinstance(devices, (list, tuple)) else [devices]))
        if not devs:
            raise WrongDevice(f"model {model_id!r} needs at least one device, got {devices!r}")
        if len(set(devs)) != len(devs):
            raise WrongDevice(f"model {model_id!r} names a device twice: {', '.join(map(str, devs))}; "
                              "accepted: each device once")
        try:
            kind = ModelKind(kind)
        except ValueError:
            raise ModelError(f"model kind {kind!r} is unknown; accepted: "
                             f"{', '.join(k.value for k in ModelKind)}") from None
        if owner is not None:
            self._check_registered(owner, "owner")
        model = Model(model_id, size, devs, kind, owner)
        try:
            for d in devs:
                model.slots[d] = _Slot(model, d)
                self._reserve_making_room(model.slots[d])
        except BaseException as exc:
            self._roll_back(model, exc)
            raise
        if owner is not None:
            owner.owned.append(model)
        self._keep(model)
        self._trace("register", model, bytes=size, kind=model.kind.value, devices=[str(d) for d in devs],
                    owner=owner.id if owner is not None else None)
        return model

    def _roll_back(self, model: Model, exc: BaseException) -> None:
        """A register that failed part-way: give back every reservation it made, and the address
        windows the backend would keep from them, so nothing stays charged (ComfyUI #15993's commit)."""
        for slot in reversed(list(model.slots.values())):
            if not slot.alive:
                continue
            try:
                self.session.release_reservation(slot.bound)
                self._trim(slot.device)
            except Exception as undo:  # the original error is the one to report; say what stayed behind
                log.error("membackend: rolling back model %r on %s failed: %s", model.id, slot.device, undo)
                exc.add_note(f"rolling back: giving back {model.id!r}'s reservation on {slot.device} failed: {undo}")
        self._trace("register_failed", model, error=type(exc).__name__)

    def _keep(self, model: Model) -> None:
        self._models[model.id] = model
        self.rules.keep(self, model)

    def _check_registered(self, model: Any, what: str = "model") -> Model:
        if not isinstance(model, Model):
            raise ModelError(f"{what} must be a Model from register(), got {type(model).__name__}")
        if self._models.get(model.id) is not model:
            raise ModelError(f"{what} {model.id!r} is not registered with this manager")
        return model

    @_locked
    def models(self) -> list[Model]:
        return list(self._models.values())

    def _reserve(self, slot: _Slot) -> None:
        slot.bind(self.session.reserve(slot.device, slot.model.size))
        self._trace("reserve", slot.model, device=str(slot.device), bytes=slot.bound.size)

    def _reserve_making_room(self, slot: _Slot) -> None:
        """Reserve ``slot``; when the backend refuses for want of memory or address space (a
        ``MemoryError``: e.g. every window a reserve-churn limit lets it keep is in use), fully unload idle
        models on the device -- least recently used first, never the current run's, never a pinned one --
        so their ranges can serve, and try again. Raises the backend's last refusal when none is left."""
        tried: set[str] = set()
        mine = set()  # the model being reserved and the models that own it: never its own victims
        m: Any = slot.model
        while m is not None:
            mine.add(m.id)
            m = m.owner
        while True:
            try:
                self._reserve(slot)
                return
            except MemoryError:
                victim = self._idle_owner(slot.device, mine | tried)
                if victim is None:
                    raise
                tried.add(victim.id)
                try:
                    self.full_unload(victim)
                except PartialFailure:
                    continue  # what could be unloaded was; the next idle model is tried
                self._trace("evict_model", victim, device=str(slot.device), bytes=0, reason="address space")

    def _idle_owner(self, device: Device, skip: set[str]) -> Model | None:
        """The least recently used model (an owner, with what it owns) with a live range on ``device`` that no
        part of the current run uses and no page of which is pinned; None when there is none."""
        for s in self._by_priority(device):
            owner = self._models.get(s.model.id)
            while owner is not None and owner.owner is not None:
                owner = owner.owner
            if owner is None or owner.id in skip or self._in_run(owner) or self._pinned(owner):
                continue
            return owner
        return None

    def _in_run(self, model: Model) -> bool:
        return model.id in self._running or any(self._in_run(child) for child in model.owned)

    def _slot(self, model: Model, device: Any) -> _Slot:
        self._check_registered(model)
        dev = Device.parse(device) if device is not None else model.devices[0]
        slot = model.slots.get(dev)
        if slot is None:
            raise WrongDevice(f"model {model.id!r} is not registered on {dev}; "
                              f"its devices: {', '.join(map(str, model.devices))}")
        return slot

    @staticmethod
    def _pages(slot: _Slot, model: Model, offset: Any, size: Any) -> tuple[int, int, int, int]:
        """Check a byte range of ``model``; returns ``(offset, size, first page, end page)``."""
        offset, size = _as_int(offset, "offset"), _as_int(size, "size")
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}")
        if offset < 0 or offset + size > model.size:
            raise OutOfRange(f"range [{offset}, {offset + size}) is outside model {model.id!r} of {model.size} "
                             f"bytes; accepted: 0 <= offset and offset + size <= {model.size}")
        ps = slot.reservation.page_size if slot.reservation is not None else 1
        return offset, size, offset // ps, (offset + size - 1) // ps + 1

    # ------------------------------------------------------------------ use

    @_locked
    def use(self, models: Iterable[Model], *, workflow: str | None = None) -> None:
        """Start a run (a workflow) that uses ``models``: they get the highest priority and may
        not be evicted whole; what else stays resident is decided by the budget (G4).
        ``workflow`` names the run in the trace (a replay's timeline marks the switch).
        Each model's load is recorded until the next ``use``, :meth:`on_idle` or :meth:`loads_done`."""
        models = [self._check_registered(m) for m in models]
        self.loads_done()
        self._running = {m.id for m in models}
        for m in models:
            self._prioritize(m)
        self._trace("use", None, models=[m.id for m in models], workflow=workflow)
        self.rules.on_workflow_switch(self, models)
        now = time.time()
        for m in models:
            self._loads[m.id] = {"model": m.id, "size": m.size, "began": now, "workflow": workflow,
                                 "resident_before": sum(s.resident_bytes() for s in m.slots.values()),
                                 "loaded": 0, "lost": self.losses.pop(m.id, None)}

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
        done, self._loads = list(self._loads.values()), {}
        for rec in done:
            rec["kind"] = "kept" if not rec["loaded"] else "reloaded" if rec["lost"] else "cold"
            if self.tracer is not None:
                self.tracer.event("load", policy=self.policy, **rec)
            for listener in list(self.load_listeners):
                try:
                    listener(rec)
                except Exception as exc:  # a listener (a log line) must never fail the policy
                    log.warning("membackend: a load listener failed: %s: %s", type(exc).__name__, exc)
        return done

    def _note_loss(self, model: Any, nbytes: int, reason: str, for_models: Iterable[Any] = ()) -> None:
        """``model`` lost ``nbytes`` resident bytes (eviction, shed, unload) for ``reason``, to make room for
        ``for_models`` (models or ids); kept for its next load record. Bytes add up until that load; the time,
        reason and models are the latest."""
        if nbytes <= 0:
            return
        mid = model.id
        if mid in self._loads:  # lost during its own load (its pages shed to fit another of the run's): said too
            self._loads[mid]["shed_during"] = self._loads[mid].get("shed_during", 0) + nbytes
        before = self.losses.get(mid)
        self.losses[mid] = {"time": time.time(), "bytes": nbytes + (before["bytes"] if before else 0),
                            "reason": reason, "for": sorted(getattr(m, "id", m) for m in for_models)}

    @_locked
    def prioritize(self, model: Model) -> None:
        """Most recently used from now on; lifts the watermark of each of its reservations."""
        self._prioritize(model)
        self._trace("prioritize", model)

    def _prioritize(self, model: Model) -> None:
        self._check_registered(model)
        model.last_used = next(self._clock)
        for slot in model.slots.values():
            slot.watermark = None

    @_locked
    def keep_warm(self, device: Any, reason: str = "budget") -> int:
        """Evict whole models, least recently used first (never one the current run uses), until the
        budget's headroom is free again; returns bytes freed. ``reason`` is traced with each eviction."""
        device = Device.parse(device)
        b = self.session.budget_query(device)
        deficit = b.headroom - b.free
        return self._evict_models(device, deficit, None, reason) if deficit > 0 else 0

    def _evict_models(self, device: Device, amount: int, protect: _Slot | None, reason: str) -> int:
        freed = 0
        if not self.rules.evicts_whole_models:
            return 0
        for slot in self._by_priority(device):
            if freed >= amount:
                break
            if slot.model.id in self._running or slot is protect:
                continue
            dropped = self._free_for_others(slot)
            if dropped:
                freed += dropped
                slot.watermark = 0
                self._trace("evict_model", slot.model, device=str(device), bytes=dropped, reason=reason)
                self._note_loss(slot.model, dropped, reason, [protect.model] if protect is not None else self._running)
        return freed

    # ------------------------------------------------------------------ faults

    def _warm_range(self, model: Model, offset: Any, size: Any, device: Any) -> "tuple[_Slot, Reservation] | None":
        """The slot and live reservation for the warm paths of :meth:`fault` and :meth:`unpin` (per weight per
        step): only an int range inside a registered model on a ``Device`` it has; None sends the caller down the
        checked path."""
        slot = model.slots.get(device) if device.__class__ is Device else None
        if slot is None or (r := slot.reservation) is None or r.released or offset.__class__ is not int \
                or size.__class__ is not int or not 0 <= offset < offset + size <= model.size \
                or self._models.get(model.id) is not model:
            return None
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
            if slot.resident.count(RESIDENT, first, last) == last - first \
                    and (slot.watermark is None or offset + size <= slot.watermark):
                model.last_used = next(self._clock)
                f = self._session_fault(slot, r, offset, size, first, last)
                if f.ok:
                    return self._faulted(slot, model, offset, size, first, last, f)
        was, self._in_fault = self._in_fault, True  # what it frees, it frees to make room for a fault
        try:
            return self._fault_making_room(model, offset, size, device)
        finally:
            self._in_fault = was

    def _fault_making_room(self, model: Model, offset: Any, size: Any, device: Any) -> Fault:
        """:meth:`fault` past its warm path: reserve again if fully unloaded, keep the headroom, evict."""
        slot = self._slot(model, device)
        offset, size, first, last = self._pages(slot, model, offset, size)
        if not slot.alive:  # used again after a full unload: reserve again, transparently
            try:
                self._reserve_making_room(slot)
            except MemoryError:  # refused for want of memory or address space, nothing left to unload
                self._trace("fault", model, device=str(slot.device), offset=offset, bytes=size, mapped=0,
                            result="oom", reason="address space")
                return Fault(False, (), first, 0)
            offset, size, first, last = self._pages(slot, model, offset, size)
        r = slot.bound
        model.last_used = next(self._clock)
        if slot.watermark is not None and offset + size > slot.watermark:
            self._trace("fault", model, device=str(slot.device), offset=offset, bytes=size, mapped=0,
                        result="fail_fast", watermark=slot.watermark)
            return Fault(False, (), first, 0)
        ps = r.page_size
        missing = slot.missing(first, last)
        need = missing - slot.kept if missing and slot.kept else missing  # its own kept memory covers the rest
        if need > 0:
            usable = self.session.budget_query(slot.device).usable
            if need > usable and self._evict(slot.device, need - usable, (slot, first, last),
                                             "headroom") < need - usable:
                # past the budget a WDDM driver would spill to shared memory and a unified pool
                # would squeeze the host: out of memory is the caller's answer instead
                self._trace("fault", model, device=str(slot.device), offset=offset, bytes=size, mapped=0,
                            result="oom", reason="budget")
                return Fault(False, (), first, 0)
        f = self._session_fault(slot, r, offset, size, first, last)
        while not f.ok:
            if not self._evict(slot.device, missing or ps, (slot, first, last), "out of memory"):
                self._trace("fault", model, device=str(slot.device), offset=offset, bytes=size, mapped=0,
                            result="oom", reason="driver")
                return f
            f = self._session_fault(slot, r, offset, size, first, last)
        return self._faulted(slot, model, offset, size, first, last, f)

    def _faulted(self, slot: _Slot, model: Model, offset: int, size: int, first: int, last: int, f: Fault) -> Fault:
        """A fault of pages ``[first, last)`` succeeded (``f.ok``): the page map follows it, the pages are pinned."""
        if f.mapped:
            slot.faulted(first, last, f.mapped)
            if slot.kept:  # ROCm 7.2: the range's kept memory, mapped again
                slot.kept = max(0, slot.kept - f.mapped)
            if model.id in self._loads:
                self._loads[model.id]["loaded"] += f.mapped
        elif slot.resident.count(RESIDENT, first, last) != last - first:
            slot.faulted(first, last, 0)  # UNKNOWN pages that turned out resident
        pins = slot.pins
        for p in range(first, last):
            pins[p] += 1
        if self.tracer is not None:
            self._trace("fault", model, device=str(slot.device), offset=offset, bytes=size, mapped=f.mapped,
                        result="mapped" if f.mapped else "resident")
        return f

    def _session_fault(self, slot: _Slot, r: Reservation, offset: int, size: int, first: int, last: int) -> Fault:
        try:
            return self.session.fault(r, offset, size)
        except Exception as exc:
            slot.fault_failed(first, last, exc)
            raise

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
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if slot.resident.count(RESIDENT, first, last) != last - first:
            return None
        return WarmRange(self, model, slot, r, offset, size, fault)

    @_locked
    def unpin(self, model: Model, offset: int, size: int, device: Any = None) -> None:
        """The op that faulted the range is done with it; its pages may be evicted again."""
        warm = self._warm_range(model, offset, size, device) if self.tracer is None else None
        if warm is not None:
            slot, r = warm
            ps = r.page_size  # the warm path, as in fault
            pins = slot.pins
            for p in range(offset // ps, (offset + size - 1) // ps + 1):
                if pins[p]:
                    pins[p] -= 1
            return
        slot = self._slot(model, device)
        _, _, first, last = self._pages(slot, model, offset, size)
        if not slot.alive:
            return
        pins = slot.pins
        for p in range(first, last):
            if pins[p]:
                pins[p] -= 1
        if self.tracer is not None:
            self._trace("unpin", model, device=str(slot.device), offset=offset, bytes=size)

    def copied(self, model: Model, offset: int, size: int, seconds: float, device: Any = None) -> None:
        """Tell the trace that ``size`` bytes were copied into ``[offset, offset+size)`` of ``model``
        in ``seconds`` (the cast path's copy of fresh pages). Nothing else happens: a replay uses
        these to model load time and to run copies that a later free must wait for."""
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
                or seconds < 0:
            raise ModelError(f"copy seconds must be a finite number >= 0, got {seconds!r}")
        if self.tracer is not None:
            slot = self._slot(model, device)
            self._trace("copy", model, device=str(slot.device), offset=_as_int(offset, "offset"),
                        bytes=_as_int(size, "copy size"), seconds=float(seconds))

    def record(self, model: Model, token: FenceToken, device: Any = None) -> None:
        """Asynchronous work (a copy) on the model's pages: frees and unloads wait for it.

        Takes no policy lock (see the class docstring): a copy thread must never
        wait for a thread that is fencing its copy. A full unload racing it either
        fences the token or makes this raise ``ReservationReleased``.
        """
        slot = self._slot(model, device)
        r = slot.reservation  # read once: a racing full unload may release it under us
        if r is None or r.released:
            raise ReservationReleased(f"model {model.id!r} has no reservation on {slot.device} (fully unloaded); "
                                      "fault it before copying into it")
        try:
            self.session.record(r, token)
        except ReservationReleased:
            raise ReservationReleased(f"model {model.id!r} was fully unloaded from {slot.device} while the copy "
                                      "was recorded; fault it again and copy again") from None

    # ------------------------------------------------------------------ eviction

    def _by_priority(self, device: Device) -> list[_Slot]:
        """Live slots on ``device``, lowest priority (least recently used) first."""
        slots = [s for m in self._models.values() for d, s in m.slots.items() if d == device and s.alive]
        return sorted(slots, key=lambda s: s.model.last_used)

    def _evict(self, device: Device, amount: int, protect: tuple[_Slot, int, int], reason: str) -> int:
        """Free at least ``amount`` bytes: whole models outside the current run first (least recently
        used first), then unpinned pages of the run's own models, lowest priority first, top down."""
        freed = self._evict_models(device, amount, protect[0], reason)
        for slot in self._by_priority(device):
            if freed >= amount:
                break
            if slot is protect[0]:  # its own pages: only where the policy sheds them for its faults
                if not self.rules.sheds_own_pages_for_a_fault:
                    continue
                dropped = self._shed(slot, amount - freed, protect)
            else:
                dropped = self._free_for_others(slot, amount - freed, protect)
            if dropped:
                freed += dropped
                self._trace("evict", slot.model, device=str(device), bytes=dropped, reason=reason,
                            watermark=slot.watermark)
                if slot is not protect[0]:
                    self._note_loss(slot.model, dropped, reason, [protect[0].model])
        return freed

    def _frees_by_release(self) -> bool:
        """The policy's :meth:`ResidencyPolicy.frees_by_release` for this session."""
        return self.rules.frees_by_release(self.session)

    def _free_for_others(self, slot: _Slot, amount: float = math.inf,
                         protect: tuple[_Slot, int, int] | None = None) -> int:
        """Free ``slot``'s model for another: where only a release returns memory (:meth:`_frees_by_release`)
        and nothing of it is pinned or viewed, by releasing its reservation (the model reserves again on its
        next fault), and not at all while a page of it is pinned or viewed; elsewhere up to ``amount`` bytes of
        its unpinned pages."""
        if not self._frees_by_release():
            return self._shed(slot, amount, protect)
        if any(slot.pins) or self._viewed(slot):
            return 0  # its pages would stay the driver's: nothing for anyone else
        kept = slot.kept  # freed pages whose memory the range still holds: the release returns it too
        try:
            return self._unload_slot(slot, True) + kept
        except TensorAlive:  # a tensor appeared meanwhile: nothing changed, nothing freed
            return 0

    def _shed(self, slot: _Slot, amount: float, protect: tuple[_Slot, int, int] | None) -> int:
        """Free unpinned resident (or UNKNOWN) pages of ``slot`` from the top down, up to ``amount``
        bytes (rounded up to pages). Another model's reservation gets a watermark at the lowest page
        freed; the protected reservation (``protect``: a fault's own, or :meth:`shed`'s) keeps the
        protected range and gets none."""
        r = slot.bound
        ps = r.page_size
        own = protect is not None and protect[0] is slot
        lo, hi = (protect[1], protect[2]) if protect is not None and own else (0, 0)
        resident, pins = slot.resident, slot.pins
        held = self._viewed(slot)  # pages a live tensor views are skipped, as pinned ones are

        def evictable(p: int) -> bool:
            return bool(resident[p]) and not pins[p] and not lo <= p < hi and p not in held

        freed, lowest, p = 0, None, r.pages - 1
        while p >= 0 and freed < amount:
            if not evictable(p):
                p -= 1
                continue
            end = p + 1
            limit = math.ceil((amount - freed) / ps) if amount != math.inf else math.inf  # pages still wanted
            while p >= 0 and evictable(p) and end - p <= limit:
                p -= 1
            start = p + 1
            dropped = self._free_pages(slot, start, end)
            freed += dropped
            if dropped:  # a free refused under a live tensor drops nothing: no watermark over resident pages
                lowest = start * ps
        if lowest is not None and not own:
            slot.watermark = lowest if slot.watermark is None else min(slot.watermark, lowest)
        return freed

    def _viewed(self, slot: _Slot) -> frozenset[int] | set[int]:
        """Pages of ``slot`` that a live tensor from ``membackend._tensors`` views (never evicted)."""
        views = getattr(self.session, "views", None)
        spans = views(slot.reservation) if views is not None else ()
        if not spans:
            return frozenset()
        ps = slot.bound.page_size
        return {p for a, b in spans for p in range(a // ps, (b - 1) // ps + 1)}

    def _free_pages(self, slot: _Slot, start: int, end: int) -> int:
        r = slot.bound
        self._fence_before_free(slot)
        try:
            dropped = self.session.free(r, start * r.page_size, (end - start) * r.page_size)
        except TensorAlive:  # a tensor made over these pages since they were chosen: skipped, nothing changed
            return 0
        except Exception as exc:
            slot.free_failed(start, end, exc)
            raise
        slot.freed(start, end, dropped)
        if self._frees_by_release():
            slot.kept += dropped  # the range keeps their memory for its own next faults
        return dropped

    def _fence_before_free(self, slot: _Slot) -> None:
        self.rules.fence_before_free(self.session, slot.device, self._in_fault)

    # ------------------------------------------------------------------ unload

    @_locked
    def free_memory(self, amount: int, device: Any, reason: str = "free_memory") -> int:
        """Free at least ``amount`` bytes on ``device`` by priority (pinned pages stay); returns bytes freed.
        ``reason`` is what each model's next load record says it lost its pages for."""
        amount = _as_int(amount, "amount")
        if amount < 0:
            raise InvalidSize(f"amount must be >= 0 bytes, got {amount}")
        device = Device.parse(device)
        freed = 0
        for slot in self._by_priority(device):
            if freed >= amount:
                break
            dropped = self._free_for_others(slot, amount - freed)
            freed += dropped
            self._note_loss(slot.model, dropped, reason)
        if freed < amount:
            log.info("membackend: free_memory(%d) on %s freed only %d bytes: the rest is pinned", amount, device, freed)
        self._trace("free_memory", None, device=str(device), bytes=amount, result=freed)
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
        """
        self._check_registered(model)
        if self.rules.unload_keeps_reservation:
            dropped = sum(self.drop_pages(model, d, unpin=True) or 0 for d in model.devices)
            self._trace("full_unload", model, bytes=dropped, released=False, owned=[], via=self._via)
            return dropped
        failures: list[tuple[str, BaseException]] = []
        before = self._committed(model)
        dropped = self._unload(model, failures, self._via)
        if before is not None:
            self._trace("commit", model, committed_before=before, committed_after=self._committed(model))
        if failures:
            raise PartialFailure(f"full unload of model {model.id!r}", failures)
        return dropped

    @_locked
    def drop_pages(self, model: Model, device: Any = None, *, unpin: bool = False) -> int | None:
        """Free every unpinned resident page of ``model`` on ``device`` (``unpin``: its pins go first, so every
        page) and keep its reservation; faults reaching the freed pages fail fast until the model is prioritized
        again. Returns the bytes freed; None when the reservation is not alive or nothing of it is resident."""
        slot = self._slot(model, device)
        if not slot.alive:
            return None
        if unpin:
            slot.clear_pins()
        if not any(slot.resident):
            return None
        return self._shed(slot, math.inf, None)

    @_locked
    def full_unload_unless_pinned(self, model: Model) -> "Unloaded | None":
        """:meth:`full_unload`, unless a page of the model (or of what it owns) is pinned: then None, and
        nothing was done.

        The pin check and the unload are one decision under the policy's lock, so a
        fault on another thread either pins first (None here) or comes after the
        unload (and reserves anew, as any fresh fault). Raises what ``full_unload``
        raises (``PartialFailure``)."""
        self._check_registered(model)
        if self._pinned(model):
            return None
        alive = [slot.bound for slot in model.slots.values() if slot.alive]
        dropped = self.full_unload(model)
        return Unloaded(dropped, len(alive), sum(r.released for r in alive), sum(r.size for r in alive))

    def _pinned(self, model: Model) -> bool:
        return any(any(slot.pins) for slot in model.slots.values() if slot.alive) or \
            any(self._pinned(child) for child in model.owned)

    #: why a full unload happens when it is not the caller's own request (traced as ``via``: a replay
    #: re-executes only the requests, not their consequences)
    _via: str | None = None

    def _unload(self, model: Model, failures: list[tuple[str, BaseException]], via: str | None) -> int:
        dropped = 0
        for child in list(model.owned):
            dropped += self._unload(child, failures, f"owner {model.id}")
        release = self.session.capabilities.release_on_full_unload
        for slot in model.slots.values():
            if not slot.alive:
                continue
            try:
                dropped += self._unload_slot(slot, release)
            except Exception as exc:
                failures.append((f"model {model.id!r} on {slot.device}", exc))
        self._trace("full_unload", model, bytes=dropped, released=release, owned=[c.id for c in model.owned],
                    via=via)
        self._note_loss(model, dropped, via or "full unload")
        return dropped

    def _unload_slot(self, slot: _Slot, release: bool) -> int:
        r = slot.bound
        self.session.fence(reservation=r)
        pins = slot.pins
        slot.clear_pins()  # its pins go with it
        if not release:
            return self._shed(slot, math.inf, None)
        try:
            dropped = self.session.release_reservation(r)
        except TensorAlive:  # refused, nothing changed: the model keeps its pages and pins
            slot.pins = pins
            raise
        except Exception as exc:
            slot.free_failed(0, r.pages, exc)
            raise
        slot.released()
        return dropped

    def _committed(self, model: Model) -> int | None:
        """Process memory the platform charges (Windows private bytes; a simulation's commit accounting),
        for the trace around each unload; None where the platform charges none."""
        inspect = getattr(self.session, "inspect", None)
        state = inspect(model.devices[0]) if inspect is not None else None
        if state is not None and state.committed is not None:
            return state.committed
        return process_private_bytes()

    @_locked
    def unload_all(self) -> int:
        """Full unload of every registered model (ComfyUI's ``unload_all_models``), then give back
        what the backend keeps for reuse (``Session.trim``), so the driver is back at its baseline (G1).

        Carries on past failures and raises one :class:`~membackend.types.PartialFailure`
        naming every model, device (and the trim) that failed. Returns bytes that were resident.
        """
        failures: list[tuple[str, BaseException]] = []
        dropped = 0
        self._via = "unload_all"
        try:
            for m in [m for m in self._models.values() if m.owner is None]:
                try:
                    dropped += self.full_unload(m)
                except PartialFailure as exc:
                    failures += exc.failures
                except Exception as exc:
                    failures.append((f"model {m.id!r}", exc))
        finally:
            self._via = None
        try:
            self._trim()
        except Exception as exc:
            failures.append(("trim", exc))
        self._trace("unload_all", None, bytes=dropped, failures=len(failures))
        if failures:
            raise PartialFailure("unload_all", failures)
        return dropped

    def _trim(self, device: Device | None = None) -> int:
        """Give back what the backend keeps for reuse on ``device`` (every device when None)."""
        trim = getattr(self.session, "trim", None)  # sessions before issue 7 have no trim: nothing to give back
        return trim(device) if trim is not None else 0

    @_locked
    def on_idle(self) -> int:
        """The caller is idle (no run in progress, e.g. ComfyUI's prompt queue is empty): give back what
        the backend keeps for reuse — recycled physical handles, address windows kept against a
        reserve-churn limit — so held memory never outlives the work that needed it. Resident models
        stay resident (G4). Returns the bytes given back."""
        self.loads_done()
        self._running = set()
        given = self._trim()
        self._trace("idle", None, bytes=given)
        return given

    @_locked
    def unregister(self, model: Model) -> None:
        """Full unload, then forget the model (and what it owns).

        When the unload fails (``PartialFailure``), the model stays registered so
        that unregistering it again retries.
        """
        self._unregister(model, None)

    def _unregister(self, model: Model, via: str | None) -> None:
        self._via = "unregister"
        try:
            self.full_unload(model)
        finally:
            self._via = None
        for child in list(model.owned):
            self._unregister(child, f"owner {model.id}")
        if model.owner is not None and model in model.owner.owned:
            model.owner.owned.remove(model)
        self._models.pop(model.id, None)
        self.losses.pop(model.id, None)  # nothing loads it again: its losses would only pile up
        self._loads.pop(model.id, None)
        self._trace("unregister", model, via=via)

    # ------------------------------------------------------------------ per-reservation controls
    # (what a comfy-aimdo ModelVBAR offers per reservation; the ComfyUI facade calls them)

    @_locked
    def deprioritize(self, model: Model) -> None:
        """Least recently used from now on: the model's pages are the first evicted."""
        self._check_registered(model)
        model.last_used = 0
        self._trace("deprioritize", model)

    @_locked
    def shed(self, model: Model, amount: int, device: Any = None, floor: int = 0) -> int:
        """Free up to ``amount`` bytes of ``model``'s unpinned resident pages from the top down,
        never below byte ``floor``; returns bytes freed. The reservation stays (no watermark is set)."""
        slot = self._slot(model, device)
        amount, floor = _as_int(amount, "amount"), _as_int(floor, "floor")
        if amount < 0 or floor < 0:
            raise InvalidSize(f"amount and floor must be >= 0 bytes, got {amount} and {floor}")
        if not slot.alive or not amount:
            return 0
        ps = slot.bound.page_size
        low = -(-floor // ps)  # pages wholly above the floor
        freed = self._shed(slot, amount, (slot, 0, low)) if low < slot.bound.pages else 0
        self._trace("shed", model, device=str(slot.device), bytes=amount, result=freed, floor=floor)
        self._note_loss(model, freed, "shed by its owner")
        return freed

    @_locked
    def set_watermark(self, model: Model, limit: int | None, device: Any = None) -> None:
        """Faults reaching above byte ``limit`` fail fast until the model is prioritized (None: no limit)."""
        slot = self._slot(model, device)
        slot.watermark = None if limit is None else _as_int(limit, "watermark")
        self._trace("set_watermark", model, device=str(slot.device), limit=slot.watermark)

    @_locked
    def watermark(self, model: Model, device: Any = None) -> int | None:
        return self._slot(model, device).watermark

    @_locked
    def residency(self, model: Model, device: Any = None) -> list[int]:
        """One entry per page of the model's reservation: bit 0 resident (or possibly resident),
        bit 1 pinned; empty when the reservation is not alive."""
        slot = self._slot(model, device)
        if not slot.alive:
            return []
        return [(1 if r else 0) | (2 if p else 0) for r, p in zip(slot.resident, slot.pins)]

    @_locked
    def pinned_and_evictable(self, model: Model, device: Any = None) -> tuple[int, int]:
        """Bytes of the model's pages on ``device`` that are pinned (a layer in use now) and that are resident
        (or possibly resident) and not pinned; ``(0, 0)`` when the reservation is not alive. The status's
        figures per model: the page map, as :meth:`residency` gives it, summed."""
        slot = self._slot(model, device)
        if not slot.alive:
            return 0, 0
        pins, ps = slot.pins, slot.bound.page_size
        evictable = sum(1 for r, p in zip(slot.resident, pins) if r and not p)
        return (len(pins) - pins.count(0)) * ps, evictable * ps

    @_locked
    def evictable(self, device: Any) -> int:
        """Bytes of unpinned resident pages on ``device`` (what eviction could give back now)."""
        device = Device.parse(device)
        total = 0
        for slot in self._by_priority(device):
            ps = slot.bound.page_size
            held = self._viewed(slot)
            resident, pins = slot.resident, slot.pins
            if not held and pins.count(0) == len(pins):  # ComfyUI asks per load: counted in C when nothing is pinned
                total += (len(resident) - resident.count(GONE)) * ps
                continue
            total += sum(1 for i, (r, p) in enumerate(zip(resident, pins)) if r and not p and i not in held) * ps
        return total

    # ------------------------------------------------------------------ reporting

    @_locked
    def stats(self, device: Any = None) -> dict[str, Any]:
        """Per model: resident bytes and whether its reservation is alive, on one device or all.

        Resident bytes equal the session ledger's for the model's reservations, failed
        verbs included (pages they may have changed are counted as the ledger counts them).
        """
        dev = Device.parse(device) if device is not None else None
        return {
            m.id: {
                "resident": sum(s.resident_bytes() for d, s in m.slots.items() if dev is None or d == dev),
                "reserved": any(s.alive for d, s in m.slots.items() if dev is None or d == dev),
            }
            for m in self._models.values()
        }

    def trace(self, event: str, model: Model | None, **fields: Any) -> None:
        """Hand the tracer (where one watches) a decision: ``event`` with the policy's name, the model's id and
        ``fields`` (a policy's own decisions are traced through this too)."""
        if self.tracer is not None:
            self.tracer.event(event, policy=self.policy, model=model.id if model else None, **fields)

    _trace = trace

