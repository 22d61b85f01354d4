"""The decisions a :class:`~membackend.ResidencyManager` leaves to its policy: :class:`ResidencyPolicy`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, MutableMapping

from ..types import Device

if TYPE_CHECKING:
    from .._session import Session
    from .model import Model


class ResidencyPolicy:
    """The decisions a :class:`ResidencyManager` leaves to its policy: membackend's by default.

    Subclass it and override what differs (the stock comfy-aimdo model in ``membackend.lab`` is one); the
    manager calls each member under its lock, so a member may call the manager's public methods, never wait
    for another thread. The members that take a ``manager`` are handed the :class:`ResidencyManager` calling
    them (typed ``Any`` here: the policy is a part of the residency package, which never imports the
    manager). The flags:

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

    def keep(self, manager: Any, model: "Model") -> None:
        """``model`` was just registered (and is in the registry)."""

    def on_workflow_switch(self, manager: Any, models: list["Model"]) -> None:
        """A run that uses ``models`` starts (:meth:`ResidencyManager.use`): membackend keeps the others
        resident while the budget allows (G4), evicting whole models, least recently used first, past it."""
        for device in {d for m in manager.models() for d in m.devices}:
            manager.keep_warm(device)

    def full_unload_of(self, model: "Model", via: str | None, unload: Callable[["Model", str | None], int]) -> int:
        """Every full unload of ``model`` runs here: the caller's own (:meth:`ResidencyManager.full_unload`,
        ``via`` None) and each one another request makes, ``via`` naming it (``"unload_all"``, ``"unregister"``;
        None for :meth:`ResidencyManager.full_unload_unless_pinned` and the unloads that make address space for a
        reservation). ``unload(model, via)`` is the manager's full unload, which this default runs; the answer is
        the bytes that were resident, and what ``unload`` raises (``PartialFailure``) reaches the caller. A policy
        overrides it to wrap every unload (count them, inject a failure) or to replace it."""
        return unload(model, via)

    def fence_before_free(self, session: "Session", device: Device, during_fault: bool) -> None:
        """Before the manager frees pages on ``device`` (``during_fault``: to make room for a fault). The
        session already fences the reservation's recorded work before every free (G2): nothing to add."""

    def frees_by_release(self, session: "Session") -> bool:
        """Whether only releasing a reservation returns memory to the driver (``memory_returns_on_unmap`` false:
        ROCm 7.2); freeing pages then helps only their own reservation, which maps them again."""
        return not session.capabilities.memory_returns_on_unmap
