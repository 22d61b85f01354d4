"""Whole models leaving memory: full unloads (G1, G5), unloading everything, forgetting a model, and making
address space for a reservation by unloading idle models (:class:`Unloading`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from .._hostmem import process_private_bytes
from ..types import Device, PartialFailure
from .model import Model, Unloaded
from .slots import Slot

if TYPE_CHECKING:
    from .eviction import Eviction
    from .loads import LoadBook
    from .registry import Registry

log = logging.getLogger(__name__)

#: one failed part of an unload: what failed (a model on a device, the trim) and its error
Failures = list[tuple[str, BaseException]]


class Unloading:
    """The manager's unloads, on its registry. Every method runs under the registry's lock (its callers hold it)
    and carries on past failures, collecting them for one :class:`~membackend.types.PartialFailure`.

    Every full unload -- the caller's own (``ResidencyManager.full_unload``), and each one unload-all,
    unregister, a full unload unless pinned and the unloads for address space make -- runs :meth:`full_unload`,
    which hands it to the policy's hook (:meth:`~membackend.ResidencyPolicy.full_unload_of`) with why it
    happens (``via``) as an argument; :meth:`unload_one` is the hook's default body, called by nothing else.

    ``eviction`` frees the slots; ``loads`` is the manager's load book; ``sweep()`` unregisters the cached
    models with nothing left reserved (``Contents.sweep``), bound by the manager once both parts exist."""

    #: ``Contents.sweep``: the manager binds it once both parts exist (each calls the other)
    sweep: Callable[[], int]

    def __init__(self, registry: Registry, loads: LoadBook, eviction: Eviction):
        self.registry = registry
        self.loads = loads
        self.eviction = eviction

    # ------------------------------------------------------------------ reserving

    def roll_back(self, model: Model, exc: BaseException) -> None:
        """A register that failed part-way: give back every reservation it made, and the address
        windows the backend would keep from them, so nothing stays charged (ComfyUI #15993's commit)."""
        reg = self.registry
        for slot in reversed(list(model.slots.values())):
            if not slot.alive:
                continue
            try:
                reg.session.release_reservation(slot.bound)
                self.trim(slot.device)
            except Exception as undo:  # the original error is the one to report; say what stayed behind
                log.error("membackend: rolling back model %r on %s failed: %s", model.id, slot.device, undo)
                exc.add_note(f"rolling back: giving back {model.id!r}'s reservation on {slot.device} failed: {undo}")
        reg.trace("register_failed", model, error=type(exc).__name__)

    def reserve(self, slot: Slot) -> None:
        slot.bind(self.registry.session.reserve(slot.device, slot.model.size))
        self.registry.trace("reserve", slot.model, device=str(slot.device), bytes=slot.bound.size)

    def reserve_making_room(self, slot: Slot) -> None:
        """Reserve ``slot``; when the backend refuses for want of memory or address space (a
        ``MemoryError``: e.g. every window a reserve-churn limit lets it keep is in use), fully unload idle
        models on the device -- least recently used first, never the current run's, never a pinned one --
        so their ranges can serve, and try again. Raises the backend's last refusal when none is left."""
        tried: set[str] = set()
        mine = set()  # the model being reserved and the models that own it: never its own victims
        m: Model | None = slot.model
        while m is not None:
            mine.add(m.id)
            m = m.owner
        while True:
            try:
                self.reserve(slot)
                return
            except MemoryError:
                victim = self.idle_owner(slot.device, mine | tried)
                if victim is None:
                    raise
                tried.add(victim.id)
                try:
                    self.full_unload(victim, None)
                except PartialFailure:
                    continue  # what could be unloaded was; the next idle model is tried
                self.registry.trace("evict_model", victim, device=str(slot.device), bytes=0, reason="address space")

    def idle_owner(self, device: Device, skip: set[str]) -> Model | None:
        """The least recently used model (an owner, with what it owns) with a live range on ``device`` that no
        part of the current run uses and no page of which is pinned; None when there is none."""
        registry = self.registry.models
        for s in self.eviction.by_priority(device):
            owner = registry.get(s.model.id)
            while owner is not None and owner.owner is not None:
                owner = owner.owner
            if owner is None or owner.id in skip or self.in_run(owner) or self.pinned(owner):
                continue
            return owner
        return None

    def in_run(self, model: Model) -> bool:
        return model.id in self.registry.running or any(self.in_run(child) for child in model.owned)

    def let_go(self, model: Model, reason: str) -> None:
        """End every hold on the pages of ``model`` and of what it owns (their own request: at once)."""
        for slot in model.slots.values():
            self.eviction.let_go(slot, reason, for_others=False)
        for child in model.owned:
            self.let_go(child, reason)

    def pinned(self, model: Model) -> bool:
        return any(any(slot.pins) for slot in model.slots.values() if slot.alive) or \
            any(self.pinned(child) for child in model.owned)

    # ------------------------------------------------------------------ unloading

    def full_unload(self, model: Model, via: str | None) -> int:
        """Every full unload of ``model`` (checked: registered here): the policy's hook runs it, told ``via``,
        why it happens when it is not the caller's own request (None: it is; traced as ``via``: a replay
        re-executes only the requests, not their consequences). Returns bytes that were resident."""
        reg = self.registry
        return reg.policy.full_unload_of(reg.registered(model), via, self.unload_one)

    def unload_one(self, model: Model, via: str | None) -> int:
        """One model's full unload as the manager makes it: the default of the policy's hook, which
        :meth:`full_unload` hands it (nothing else calls it, so nothing bypasses the hook)."""
        reg = self.registry
        if reg.policy.unload_keeps_reservation:
            dropped = sum(self.eviction.drop_pages(reg.slot(model, d), unpin=True) or 0 for d in model.devices)
            reg.trace("full_unload", model, bytes=dropped, released=False, owned=[], via=via)
            return dropped
        failures: Failures = []
        before = self.committed(model)
        dropped = self.unload(model, failures, via)
        if before is not None:
            reg.trace("commit", model, committed_before=before, committed_after=self.committed(model))
        if failures:
            raise PartialFailure(f"full unload of model {model.id!r}", failures)
        return dropped

    def unless_pinned(self, model: Model) -> Unloaded | None:
        """:meth:`full_unload` unless a page of the model (or of what it owns) is pinned: then None. The model's
        own request: what holds its pages lets go first (:mod:`.holds`)."""
        self.let_go(model, "full unload")
        if self.pinned(model):
            return None
        alive = [slot.bound for slot in model.slots.values() if slot.alive]
        dropped = self.full_unload(model, None)
        return Unloaded(dropped, len(alive), sum(r.released for r in alive), sum(r.size for r in alive))

    def unload(self, model: Model, failures: Failures, via: str | None) -> int:
        """Empty every live slot of ``model`` and of what it owns (first), releasing each reservation where the
        capabilities say so; failures are appended to ``failures``. Returns bytes that were resident."""
        reg = self.registry
        dropped = 0
        for child in list(model.owned):
            dropped += self.unload(child, failures, f"owner {model.id}")
        release = reg.session.capabilities.release_on_full_unload
        for slot in model.slots.values():
            if not slot.alive:
                continue
            try:
                dropped += self.eviction.empty(slot, release)
            except Exception as exc:
                failures.append((f"model {model.id!r} on {slot.device}", exc))
        reg.trace("full_unload", model, bytes=dropped, released=release, owned=[c.id for c in model.owned],
                  via=via)
        self.loads.lost(model, dropped, via or "full unload")
        return dropped

    def committed(self, model: Model) -> int | None:
        """Process memory the platform charges (Windows private bytes; a simulation's commit accounting),
        for the trace around each unload; None where the platform charges none."""
        state = self.registry.session.inspect(model.devices[0])
        if state is not None and state.committed is not None:
            return state.committed
        return process_private_bytes()

    def everything(self) -> int:
        """:meth:`~membackend.ResidencyManager.unload_all`."""
        reg = self.registry
        failures: Failures = []
        dropped = 0
        for model in [x for x in reg.models.values() if x.owner is None]:
            try:
                dropped += self.full_unload(model, "unload_all")
            except PartialFailure as exc:
                failures += exc.failures
            except Exception as exc:
                failures.append((f"model {model.id!r}", exc))
        self.sweep()  # the cache went with everything: its models go too
        try:
            self.trim()
        except Exception as exc:
            failures.append(("trim", exc))
        reg.trace("unload_all", None, bytes=dropped, failures=len(failures))
        if failures:
            raise PartialFailure("unload_all", failures)
        return dropped

    def trim(self, device: Device | None = None) -> int:
        """Give back what the backend keeps for reuse on ``device`` (every device when None)."""
        return self.registry.session.trim(device)

    def unregister(self, model: Model, via: str | None) -> None:
        """Full unload, then forget ``model`` and what it owns; a failed unload leaves it registered."""
        reg = self.registry
        self.full_unload(model, "unregister")
        for child in list(model.owned):
            self.unregister(child, f"owner {model.id}")
        if model.owner is not None and model in model.owner.owned:
            model.owner.owned.remove(model)
        reg.models.pop(model.id, None)
        self.loads.forget(model.id)
        reg.trace("unregister", model, via=via)
