"""Stock ComfyUI + comfy-aimdo 0.5.x on the VMM mechanism: the "stock" side of every replay.

:class:`AimdoStockVmm` makes the generic VMM backend do what comfy-aimdo does with physical
memory (each behaviour's source is on its method); :class:`AimdoStock` is the stock residency
policy and :class:`StockManager` the residency manager over it; :class:`AimdoLoadManager` is that
manager with aimdo's pressure path during a load (:class:`AimdoLoad`). Comparison only: automatic
selection never picks it (its probe scores 0). The managers' old names, ``StockPolicy`` and
``AimdoLoadPolicy``, still give them for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, MutableMapping

from ..._backends.vmm import VmmBackend
from ..._backends.vmm.handles import HandleKeeper
from ..._backends.vmm.pages import PageMapper
from ..._backends.vmm.parts import Parts
from ..._drivers.open import simulated_failures
from ..._lazy import old_names
from ..._residency import Model, ResidencyManager, ResidencyPolicy
from ...platform import Platform
from ...types import Candidate, Capabilities, Device, Score

if TYPE_CHECKING:
    from ..._session import Session
    from ..._trace import TraceObserver

__all__ = ["AimdoStock", "AimdoLoad", "StockManager", "stock_platform", "AimdoStockVmm", "AimdoLoadManager",
           "AIMDO_PAGE"]

log = logging.getLogger(__name__)

MiB = 1 << 20
#: comfy-aimdo's VBAR page: 32 MiB
AIMDO_PAGE = 32 * MiB


class AimdoStock(ResidencyPolicy):
    """Today's ComfyUI + comfy-aimdo as a residency policy (:class:`StockManager` is the manager over it).

    * A full unload frees the pages (``vbar.free_memory``, after a device-wide
      sync) but the reservation (the ``ModelVBAR``) stays alive until the model
      object is garbage-collected: "The ModelVBAR object (the VA reservation)
      stays in BaseModel.dynamic_vbars for as long as the BaseModel lives"
      (ComfyUI's ``unload_all_models``; ComfyUI #15993).
      What the model owns indirectly is left alone (the Hook delegate of
      ComfyUI #15533 survives).
    * Frees are fenced by a device-wide sync (comfy-aimdo's VBAR free paths
      call ``cuCtxSynchronize``), not per reservation.
    * When the workflow changes, the models of the previous one lose their
      residency: ComfyUI's cache drops their outputs and the unload frees their
      pages (ComfyUI #14519: image → video → image reloads everything).
    * aimdo evicts pages by VBAR priority, never whole models (``vbars_free``), and
      ``vbars_free_for_vbar`` walks the faulting VBAR too, from its top page down.
    * Budgets are the backend's mem-get-info figures as reported.

    The registry holds models weakly, so dropping the last reference is what
    releases a reservation, as garbage collection does in ComfyUI.
    """

    name = "stock"
    sheds_own_pages_for_a_fault = True
    evicts_whole_models = False
    unload_keeps_reservation = True

    def registry(self) -> MutableMapping[str, Model]:
        return weakref.WeakValueDictionary()

    def keep(self, manager: ResidencyManager, model: Model) -> None:
        # the finalizer holds the model's slots (its dict of them), never the model itself
        weakref.finalize(model, _release_on_gc, manager.session, list(model.slots.values()), manager.tracer)

    def on_workflow_switch(self, manager: ResidencyManager, models: list[Model]) -> None:
        keep = {m.id for m in models}
        for m in manager.models():
            if m.id in keep:
                continue
            for device in m.devices:
                dropped = manager.drop_pages(m, device)
                if dropped is not None:
                    manager.trace("evict_model", m, device=str(device), bytes=dropped, reason="workflow change")

    def fence_before_free(self, session: Session, device: Device, during_fault: bool) -> None:
        session.fence(device)  # aimdo: cuCtxSynchronize before VBAR unmaps


class AimdoLoad(AimdoStock):
    """:class:`AimdoStock` with comfy-aimdo 0.5.x's pressure path during a load.

    A fault that must make room calls ``vbars_free``, which in 0.5.x skips
    both of its ``cuCtxSynchronize`` calls while the thread's malloc graph is
    sync-paused, as ComfyUI 0.35's ``model_prefetch`` runs it; so evictions
    made by a fault are not fenced. Other frees (a workflow switch, an unload:
    ``vbar_free_memory``) still synchronize the device first.
    """

    def fence_before_free(self, session: Session, device: Device, during_fault: bool) -> None:
        if not during_fault:
            super().fence_before_free(session, device, during_fault)


class StockManager(ResidencyManager):
    """The residency manager over :class:`AimdoStock` (or ``policy``): today's ComfyUI + comfy-aimdo,
    reproduced for side-by-side comparison (its :attr:`policy_name` is ``stock``)."""

    def __init__(self, session: Session, *, policy: AimdoStock | None = None, tracer: TraceObserver | None = None):
        super().__init__(session, policy=policy if policy is not None else AimdoStock(), tracer=tracer)


def _release_on_gc(session: Session, slots: list[Any], tracer: TraceObserver | None) -> None:
    """AimdoStock: the reservation goes back only when the model object is collected."""
    for slot in slots:
        if slot.alive and slot.reservation is not None:  # alive: it holds a reservation not yet released
            try:
                session.release_reservation(slot.reservation)
            except Exception as exc:  # a finalizer must not raise
                log.warning("membackend: releasing a collected model's reservation failed: %s", exc)
    if tracer is not None:
        tracer.event("release_on_gc", policy="stock", bytes=sum(s.reservation.size for s in slots if s.reservation))


def _stock_probe(machine: Any) -> Candidate:
    return Candidate("aimdo_stock", Score.NONE, "comparison only: comfy-aimdo's mechanism on the VMM backend")


def stock_platform(vendor: str, budget_source: str) -> Platform:
    """comfy-aimdo's view of a machine: on Windows the DXGI budget with its 512 MiB headroom
    (``WDDM_BUDGET_HEADROOM``, src-win/shmem-detect.c), elsewhere the driver's mem-get-info
    (``budget_source="device"``); pages kept by the policy until the model is collected."""
    return Platform(name="aimdo_stock", vendor=vendor, probe=_stock_probe, budget_source=budget_source,
                    capabilities=Capabilities(release_on_full_unload=False),
                    headroom=512 * MiB if budget_source == "wddm" else 0,
                    description="comfy-aimdo 0.5.x's free path, for side-by-side comparison only")


class AimdoStockVmm(VmmBackend):
    """The VMM mechanism doing what comfy-aimdo 0.5.x does: its own handle keeper and page mapper in
    place of the generic ones (:class:`_Mod1Handles`, :class:`_AimdoPages`).

    * Each page is created, mapped and given access on fault
      (``three_stooges``: ``cuMemCreate`` → ``cuMemMap`` → ``cuMemSetAccess``).
    * Freeing a page unmaps it and releases its handle at once
      (``mod1``: ``cuMemUnmap`` → ``cuMemRelease``; "Physical memory is
      returned to the driver, not pooled"); nothing is recycled.
    * The mechanism never synchronizes by itself: aimdo's only fence is the
      ``cuCtxSynchronize`` inside its VBAR free paths, which the policy issues
      (:class:`AimdoLoadManager`), and no free path waits for the WDDM page-in
      of a fresh mapping.
    * A failed fault is unwound with no sync (``three_stooges`` unwinds with
      ``cuMemUnmap`` → ``cuMemRelease``).

    ``carry_on``: after a simulated bugcheck, count it (the simulated driver
    does) and carry on as if the machine had survived, so figures cover the
    whole workload; False lets the bugcheck end the run.
    """

    def __init__(self, driver: Any, *, page_size: int = AIMDO_PAGE, carry_on: bool = True,
                 budget_source: str = "device"):
        super().__init__(stock_platform(driver.vendor, budget_source), driver, page_size=page_size)
        self.carry_on = carry_on

    def _choose_parts(self, capabilities: Capabilities) -> Parts:
        parts = super()._choose_parts(capabilities)
        handles = _Mod1Handles(capabilities, lambda: self.driver, self._unsafe)
        pages = _AimdoPages(capabilities, lambda: self.driver, self._use, self._generation, handles, parts.one_pool,
                            unsafe=self._unsafe)
        return dataclasses.replace(parts, handles=handles, pages=pages)

    def _unsafe(self, call: Any, *args: Any) -> None:
        bugcheck = simulated_failures()[0]
        try:
            call(*args)
        except bugcheck:
            if not self.carry_on:
                raise
            self.driver.device_synchronize()  # the bugcheck is counted by the driver; the rest must go on
            call(*args)


class _Mod1Handles(HandleKeeper):
    """``mod1``: an unmapped handle is released at once, never pooled (through ``unsafe``: a simulated
    bugcheck may be carried on from)."""

    def __init__(self, capabilities: Capabilities, driver: Callable[[], Any], unsafe: Callable[..., None]):
        super().__init__(capabilities, driver)
        self._unsafe = unsafe

    def release_or_keep(self, state: Any, handle: Any) -> None:
        self._unsafe(self._driver().release, handle)


class _AimdoPages(PageMapper):
    """comfy-aimdo's frees and unwinds: no sync of their own, each unmap through ``unsafe``."""

    def __init__(self, *args: Any, unsafe: Callable[..., None]):
        super().__init__(*args)
        self._unsafe = unsafe

    def _fence_before_drop(self, state: Any) -> None:
        """mod1 unmaps and releases page by page with no sync of its own (the policy's free paths
        sync the device; a fault's evictions do not, see :class:`AimdoLoadManager`)."""

    def _unmap(self, ptr: int, size: int) -> None:
        self._unsafe(self._driver().unmap, ptr, size)

    def _unwind(self, state: Any, r: Any, mapped: list) -> int:
        for p, h in mapped:  # three_stooges' unwind: no sync
            self._unsafe(self._driver().unmap, r.base + p * r.page_size, r.page_size)
            self.handles.release_or_keep(state, h)
        return 0


class AimdoLoadManager(StockManager):
    """The residency manager over :class:`AimdoLoad`: comfy-aimdo 0.5.x's pressure path during a load."""

    def __init__(self, session: Session, *, tracer: TraceObserver | None = None):
        super().__init__(session, policy=AimdoLoad(), tracer=tracer)


#: the managers' old names (they are residency managers, not policies: issue 44), each to its new one; they
#: still give the same class for one release (:func:`renamed`)
RENAMED = {"StockPolicy": "StockManager", "AimdoLoadPolicy": "AimdoLoadManager"}


def renamed(module: str, name: str) -> type[StockManager]:
    """The manager old name ``name`` stands for, for the ``__getattr__`` of ``module`` (this one,
    ``membackend.lab.simulated``, ``membackend.lab``), with a DeprecationWarning at the caller's line naming the
    new name."""
    new = RENAMED[name]
    warnings.warn(f"{module}.{name} is deprecated: it is a residency manager, {module}.{new} (the same class); "
                  f"{module}.{name} goes in the next release", DeprecationWarning, stacklevel=3)
    manager: type[StockManager] = globals()[new]
    return manager


if TYPE_CHECKING:  # a type checker still reads the old names for their last release (the same classes)
    StockPolicy = StockManager
    AimdoLoadPolicy = AimdoLoadManager
else:  # hidden from type checkers, so that a misspelt name is an error there and not Any
    __getattr__ = old_names(__name__, RENAMED, renamed)
