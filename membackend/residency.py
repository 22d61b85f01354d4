"""The residency policy: which model pages stay resident, which are evicted, when a reservation goes back.

Backends are mechanism (a fault with no room is ``Fault(ok=False)``); this
module is policy, on top of a :class:`~membackend.session.Session`:

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
  caller.
* **Full unload** (G1, G5): fence, free every page, release the reservation
  (when the backend's capabilities say so, the default) and do the same for
  what the model owns indirectly (Hook delegates, cast buffers) and its pins.
  The model object stays usable: its next fault reserves again and reports new
  generations, so the caller copies again.
* **Keep warm by budget** (G4): a workflow switch (:meth:`~ResidencyManager.use`)
  keeps other models resident while the budget allows; when it does not,
  whole models are evicted least recently used first, never one the current
  run uses.

:class:`StockPolicy` reproduces today's ComfyUI + comfy-aimdo behaviour for side
by side comparison; its docstring gives the sources.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from .session import Session
from .trace import TraceObserver
from .types import Device, Fault, FenceToken, MembackendError, Reservation

log = logging.getLogger(__name__)

__all__ = ["ModelKind", "Model", "ResidencyManager", "StockPolicy"]


class ModelKind(str, Enum):
    DIFFUSION = "diffusion"
    TEXT_ENCODER = "text_encoder"
    VAE = "vae"
    HOOK_DELEGATE = "hook_delegate"
    CAST_BUFFER = "cast_buffer"
    OTHER = "other"


class _Slot:
    """A model's reservation on one device, with the policy's page map."""

    __slots__ = ("model", "device", "reservation", "resident", "pins", "watermark")

    def __init__(self, model: "Model", device: Device):
        self.model = weakref.proxy(model)  # a stock finalizer holds slots; they must not keep the model alive
        self.device = device
        self.reservation: Reservation | None = None
        self.resident = bytearray()
        self.pins = array("H")
        self.watermark: int | None = None  # faults reaching above fail fast; None: no limit

    def bind(self, r: Reservation) -> None:
        self.reservation = r
        self.resident = bytearray(r.pages)
        self.pins = array("H", bytes(2 * r.pages))
        self.watermark = None

    def clear_pins(self) -> None:
        self.pins = array("H", bytes(2 * len(self.pins)))

    @property
    def alive(self) -> bool:
        return self.reservation is not None and not self.reservation.released

    def resident_bytes(self) -> int:
        return self.resident.count(1) * self.reservation.page_size if self.alive else 0


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
        slot = self.slots[Device.parse(device) if device is not None else self.devices[0]]
        return slot.reservation if slot.alive else None


class ResidencyManager:
    """The membackend policy. ``tracer`` (or the session's ``TraceObserver``) receives every decision."""

    policy = "membackend"

    def __init__(self, session: Session, *, tracer: TraceObserver | None = None):
        self.session = session
        self.tracer = tracer or next((o for o in session.observers if isinstance(o, TraceObserver)), None)
        self._models: dict[str, Model] = {}
        self._clock = itertools.count(1)
        self._running: set[str] = set()  # ids of the models the current run uses

    # ------------------------------------------------------------------ registry

    def register(self, model_id: str, size: int, devices: Any, kind: ModelKind | str = ModelKind.OTHER,
                 owner: Model | None = None) -> Model:
        """Register a model of ``size`` bytes on ``devices`` and reserve its address range on each."""
        if model_id in self._models:
            raise MembackendError(f"model {model_id!r} is already registered; unregister it or pick another id")
        devs = tuple(Device.parse(d) for d in (devices if isinstance(devices, (list, tuple)) else [devices]))
        model = Model(model_id, size, devs, ModelKind(kind), owner)
        for d in devs:
            model.slots[d] = _Slot(model, d)
            self._reserve(model.slots[d])
        if owner is not None:
            owner.owned.append(model)
        self._keep(model)
        self._trace("register", model, bytes=size, kind=model.kind.value)
        return model

    def _keep(self, model: Model) -> None:
        self._models[model.id] = model

    def models(self) -> list[Model]:
        return list(self._models.values())

    def _reserve(self, slot: _Slot) -> None:
        slot.bind(self.session.reserve(slot.device, slot.model.size))
        self._trace("reserve", slot.model, device=str(slot.device), bytes=slot.reservation.size)

    def _slot(self, model: Model, device: Any) -> _Slot:
        try:
            return model.slots[Device.parse(device) if device is not None else model.devices[0]]
        except KeyError:
            raise MembackendError(f"model {model.id!r} is not registered on {device}; "
                                  f"its devices: {', '.join(map(str, model.devices))}") from None

    # ------------------------------------------------------------------ use

    def use(self, models: Iterable[Model]) -> None:
        """Start a run (a workflow) that uses ``models``: they get the highest priority and may
        not be evicted whole; what else stays resident is decided by the budget (G4)."""
        models = list(models)
        self._running = {m.id for m in models}
        for m in models:
            self.prioritize(m)
        self._trace("use", None, models=[m.id for m in models])
        self._on_workflow_switch(models)

    def prioritize(self, model: Model) -> None:
        """Most recently used from now on; lifts the watermark of each of its reservations."""
        model.last_used = next(self._clock)
        for slot in model.slots.values():
            slot.watermark = None

    def _on_workflow_switch(self, models: list[Model]) -> None:
        for device in {d for m in self._models.values() for d in m.devices}:
            self.keep_warm(device)

    def keep_warm(self, device: Any) -> int:
        """Evict whole models, least recently used first (never one the current run uses), until the
        budget's headroom is free again; returns bytes freed."""
        device = Device.parse(device)
        b = self.session.budget_query(device)
        deficit = b.headroom - b.free
        return self._evict_models(device, deficit, None, "budget") if deficit > 0 else 0

    def _evict_models(self, device: Device, amount: int, protect: _Slot | None, reason: str) -> int:
        freed = 0
        for slot in self._by_priority(device):
            if freed >= amount:
                break
            if slot.model.id in self._running or slot is protect:
                continue
            dropped = self._shed(slot, math.inf, None)
            if dropped:
                freed += dropped
                slot.watermark = 0
                self._trace("evict_model", slot.model, device=str(device), bytes=dropped, reason=reason)
        return freed

    # ------------------------------------------------------------------ faults

    def fault(self, model: Model, offset: int, size: int, device: Any = None) -> Fault:
        """Back ``[offset, offset+size)`` of ``model`` and pin it; evicts by priority when out of memory."""
        slot = self._slot(model, device)
        if not slot.alive:  # used again after a full unload: reserve again, transparently
            self._reserve(slot)
        r = slot.reservation
        model.last_used = next(self._clock)
        if slot.watermark is not None and offset + size > slot.watermark:
            self._trace("fail_fast", model, device=str(slot.device), offset=offset, bytes=size,
                        watermark=slot.watermark)
            return Fault(False, (), offset // r.page_size, 0)
        ps = r.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        missing = slot.resident.count(0, first, last) * ps
        if missing:
            usable = self.session.budget_query(slot.device).usable
            if missing > usable and self._evict(slot.device, missing - usable, (slot, first, last),
                                                "headroom") < missing - usable:
                # past the budget a WDDM driver would spill to shared memory and a unified pool
                # would squeeze the host: out of memory is the caller's answer instead
                self._trace("oom", model, device=str(slot.device), offset=offset, bytes=size, reason="budget")
                return Fault(False, (), first, 0)
        f = self.session.fault(r, offset, size)
        while not f.ok:
            if not self._evict(slot.device, missing or ps, (slot, first, last), "out of memory"):
                self._trace("oom", model, device=str(slot.device), offset=offset, bytes=size)
                return f
            f = self.session.fault(r, offset, size)
        slot.resident[first:last] = b"\x01" * (last - first)
        pins = slot.pins
        for p in range(first, last):
            pins[p] += 1
        if f.mapped:
            self._trace("fault", model, device=str(slot.device), offset=offset, bytes=f.mapped, result="mapped")
        return f

    def unpin(self, model: Model, offset: int, size: int, device: Any = None) -> None:
        """The op that faulted the range is done with it; its pages may be evicted again."""
        slot = self._slot(model, device)
        if not slot.alive:
            return
        ps = slot.reservation.page_size
        pins = slot.pins
        for p in range(offset // ps, (offset + size - 1) // ps + 1):
            if pins[p]:
                pins[p] -= 1

    def record(self, model: Model, token: FenceToken, device: Any = None) -> None:
        """Asynchronous work (a copy) on the model's pages: frees and unloads wait for it."""
        slot = self._slot(model, device)
        if not slot.alive:
            raise MembackendError(f"model {model.id!r} has no reservation on {slot.device} (fully unloaded); "
                                  "fault it before copying into it")
        self.session.record(slot.reservation, token)

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
            dropped = self._shed(slot, amount - freed, protect)
            if dropped:
                freed += dropped
                self._trace("evict", slot.model, device=str(device), bytes=dropped, reason=reason,
                            watermark=slot.watermark)
        return freed

    def _shed(self, slot: _Slot, amount: float, protect: tuple[_Slot, int, int] | None) -> int:
        """Free unpinned resident pages of ``slot`` from the top down, up to ``amount`` bytes (rounded
        up to pages). Another model's reservation gets a watermark at the lowest page freed; the
        faulting reservation gives up pages above its range without one."""
        r = slot.reservation
        ps = r.page_size
        own = protect is not None and protect[0] is slot
        lo, hi = (protect[1], protect[2]) if own else (0, 0)
        resident, pins = slot.resident, slot.pins

        def evictable(p: int) -> bool:
            return resident[p] and not pins[p] and not lo <= p < hi

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
            freed += self._free_pages(slot, start, end)
            lowest = start * ps
        if lowest is not None and not own:
            slot.watermark = lowest if slot.watermark is None else min(slot.watermark, lowest)
        return freed

    def _free_pages(self, slot: _Slot, start: int, end: int) -> int:
        r = slot.reservation
        self._fence_before_free(slot)
        dropped = self.session.free(r, start * r.page_size, (end - start) * r.page_size)
        slot.resident[start:end] = bytes(end - start)
        return dropped

    def _fence_before_free(self, slot: _Slot) -> None:
        """The session fences the reservation's recorded work before every free (G2); nothing to add."""

    # ------------------------------------------------------------------ unload

    def free_memory(self, amount: int, device: Any) -> int:
        """Free at least ``amount`` bytes on ``device`` by priority (pinned pages stay); returns bytes freed."""
        device = Device.parse(device)
        freed = 0
        for slot in self._by_priority(device):
            if freed >= amount:
                break
            freed += self._shed(slot, amount - freed, None)
        if freed < amount:
            log.info("membackend: free_memory(%d) on %s freed only %d bytes: the rest is pinned", amount, device, freed)
        self._trace("free_memory", None, device=str(device), bytes=amount, result=freed)
        return freed

    def full_unload(self, model: Model) -> int:
        """Fence, free every page, release the reservation on every device, and the same for what
        the model owns indirectly (G1, G5). Returns bytes that were resident. The model stays usable."""
        dropped = 0
        for child in list(model.owned):
            dropped += self.full_unload(child)
        for slot in model.slots.values():
            if not slot.alive:
                continue
            self.session.fence(reservation=slot.reservation)
            slot.clear_pins()  # its pins go with it
            if self.session.capabilities.release_on_full_unload:
                dropped += self.session.release_reservation(slot.reservation)
                slot.resident = bytearray(len(slot.resident))
            else:
                dropped += self._shed(slot, math.inf, None)
        self._trace("full_unload", model, bytes=dropped,
                    released=self.session.capabilities.release_on_full_unload, owned=[c.id for c in model.owned])
        return dropped

    def unload_all(self) -> int:
        """Full unload of every registered model (ComfyUI's ``unload_all_models``)."""
        return sum(self.full_unload(m) for m in list(self._models.values()) if m.owner is None)

    def unregister(self, model: Model) -> None:
        """Full unload, then forget the model (and what it owns)."""
        self.full_unload(model)
        for child in list(model.owned):
            self.unregister(child)
        if model.owner is not None and model in model.owner.owned:
            model.owner.owned.remove(model)
        self._models.pop(model.id, None)
        self._trace("unregister", model)

    # ------------------------------------------------------------------ reporting

    def stats(self, device: Any = None) -> dict[str, Any]:
        """Per model: resident bytes and whether its reservation is alive, on one device or all."""
        dev = Device.parse(device) if device is not None else None
        return {
            m.id: {
                "resident": sum(s.resident_bytes() for d, s in m.slots.items() if dev is None or d == dev),
                "reserved": any(s.alive for d, s in m.slots.items() if dev is None or d == dev),
            }
            for m in self._models.values()
        }

    def _trace(self, event: str, model: Model | None, **fields: Any) -> None:
        if self.tracer is not None:
            self.tracer.event(event, policy=self.policy, model=model.id if model else None, **fields)


class StockPolicy(ResidencyManager):
    """Today's ComfyUI + comfy-aimdo, reproduced for side-by-side comparison.

    * A full unload frees the pages (``vbar.free_memory``, after a device-wide
      sync) but the reservation (the ``ModelVBAR``) stays alive until the model
      object is garbage-collected: "The ModelVBAR object (the VA reservation)
      stays in BaseModel.dynamic_vbars for as long as the BaseModel lives"
      (reference/comfyui-internals.md, unload_all_models step 6; ComfyUI #15993).
      What the model owns indirectly is left alone (the Hook delegate of
      ComfyUI #15533 survives).
    * Frees are fenced by a device-wide sync (``cuCtxSynchronize`` on the VBAR
      paths, reference/aimdo-internals.md 1.4), not per reservation.
    * When the workflow changes, the models of the previous one lose their
      residency: ComfyUI's cache drops their outputs and the unload frees their
      pages (ComfyUI #14519: image → video → image reloads everything).
    * Budgets are the backend's mem-get-info figures as reported.

    The registry holds models weakly, so dropping the last reference is what
    releases a reservation, as garbage collection does in ComfyUI.
    """

    policy = "stock"

    def __init__(self, session: Session, *, tracer: TraceObserver | None = None):
        super().__init__(session, tracer=tracer)
        self._models = weakref.WeakValueDictionary()  # type: ignore[assignment]

    def _keep(self, model: Model) -> None:
        self._models[model.id] = model
        session, reservations = self.session, [s for s in model.slots.values()]
        weakref.finalize(model, _release_on_gc, session, reservations, self.tracer)

    def _on_workflow_switch(self, models: list[Model]) -> None:
        keep = {m.id for m in models}
        for m in list(self._models.values()):
            if m.id in keep:
                continue
            for slot in m.slots.values():
                if slot.alive and slot.resident.count(1):
                    dropped = self._shed(slot, math.inf, None)
                    self._trace("evict_model", m, device=str(slot.device), bytes=dropped, reason="workflow change")

    def _fence_before_free(self, slot: _Slot) -> None:
        self.session.fence(slot.device)  # aimdo: cuCtxSynchronize before VBAR unmaps

    def _evict_models(self, device: Device, amount: int, protect: _Slot | None, reason: str) -> int:
        return 0  # aimdo evicts pages by VBAR priority, never whole models (vbars_free)

    def full_unload(self, model: Model) -> int:
        dropped = 0
        for slot in model.slots.values():
            if slot.alive:
                slot.clear_pins()
                dropped += self._shed(slot, math.inf, None)
        self._trace("full_unload", model, bytes=dropped, released=False, owned=[])
        return dropped


def _release_on_gc(session: Session, slots: list[_Slot], tracer: TraceObserver | None) -> None:
    """StockPolicy: the reservation goes back only when the model object is collected."""
    for slot in slots:
        if slot.alive:
            try:
                session.release_reservation(slot.reservation)
            except MembackendError as exc:  # a finalizer must not raise
                log.warning("membackend: releasing a collected model's reservation failed: %s", exc)
    if tracer is not None:
        tracer.event("release_on_gc", policy="stock", bytes=sum(s.reservation.size for s in slots if s.reservation))
