"""What the parts of one residency manager share: :class:`Registry`.

The manager (:mod:`.manager`, the front) makes one registry and composes its parts over it -- faulting,
eviction, unloading, the content tags and cache, and the warm ranges and holds it hands out. A part reads and
changes the shared state here and calls another part only through a callable the manager handed it when it
composed them; no part imports or holds the manager.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping

from ..types import Device, ModelError, Reservation, WrongDevice
from .model import Model
from .slots import Slot

if TYPE_CHECKING:  # annotations only: residency never imports the session or the tracer
    from .._session import Session
    from .._trace import TraceObserver
    from .policy import ResidencyPolicy

log = logging.getLogger(__name__)

__all__ = ["Registry"]


class Registry:
    """The state the parts of one residency manager share, and the steps over it that every part takes.

    * ``session``: the :class:`~membackend._session.Session` the policy runs on (its public methods only);
    * ``policy``: the :class:`~.policy.ResidencyPolicy` whose decisions the parts follow;
    * ``tracer``: what every decision is traced to (None: nothing watches);
    * ``models``: the registered models by id (the mapping ``policy.registry()`` gave);
    * ``running``: the ids of the models the current run uses (``ResidencyManager.use``), rebound per run;
    * ``clock``: the use counter each model's ``last_used`` is drawn from (priority: higher is more recent);
    * ``in_fault``: a fault is making room now (what the policy's fence before a free is told);
    * ``lock``: the one re-entrant lock every verb holds; every member here is read and changed under it, except
      ``frees``, which the session writes;
    * ``frees``: the session's count of frees per reservation id (``Session.frees_by_id``), read on the warm paths.
    """

    __slots__ = ("session", "policy", "tracer", "models", "running", "clock", "in_fault", "lock", "frees")

    def __init__(self, session: Session, policy: ResidencyPolicy, tracer: TraceObserver | None):
        self.session = session
        self.policy = policy
        self.tracer = tracer
        self.models: MutableMapping[str, Model] = policy.registry()
        self.running: set[str] = set()
        self.clock = itertools.count(1)
        self.in_fault = False
        self.lock = threading.RLock()  # re-entrant: a full unload recurses, a fault evicts through shed
        self.frees: Mapping[int, int] = session.frees_by_id

    def trace(self, event: str, model: Model | None, **fields: Any) -> None:
        """Hand the tracer (where one watches) a decision: ``event`` with the policy's name, the model's id and
        ``fields``."""
        if self.tracer is not None:
            self.tracer.event(event, policy=self.policy.name, model=model.id if model else None, **fields)

    # ------------------------------------------------------------------ the checks every verb makes

    def registered(self, model: Any, what: str = "model") -> Model:
        """``model``, where it is a :class:`Model` registered here; else :class:`ModelError` (``what`` names it)."""
        if not isinstance(model, Model):
            raise ModelError(f"{what} must be a Model from register(), got {type(model).__name__}")
        if self.models.get(model.id) is not model:
            raise ModelError(f"{what} {model.id!r} is not registered with this manager")
        return model

    def slot(self, model: Model, device: Any) -> Slot:
        """The slot of registered ``model`` on ``device`` (None: its first device); else a typed error."""
        self.registered(model)
        dev = Device.parse(device) if device is not None else model.devices[0]
        slot = model.slots.get(dev)
        if slot is None:
            raise WrongDevice(f"model {model.id!r} is not registered on {dev}; "
                              f"its devices: {', '.join(map(str, model.devices))}")
        return slot

    # ------------------------------------------------------------------ frees made past the manager

    def sync(self, slot: Slot) -> None:
        """Bring ``slot``'s page map in line with frees of its reservation the manager did not make (a caller
        that holds the session freed through it): see :meth:`Slot.unseen_frees`. One dict look-up when there
        was none. Under the lock, before the map is trusted."""
        r = slot.reservation
        if r is not None and self.frees.get(r.id, 0) != slot.frees and not r.released:
            self.unseen(slot, r)

    def unseen(self, slot: Slot, r: Reservation) -> None:
        """Frees of ``r`` made past the manager: the map stops trusting its pages, and a hold on them ends (its
        holder must stop reading pages that may be gone)."""
        frees = self.frees.get(r.id, 0)
        log.info("membackend: model %s on %s: %d free(s) of its reservation were made past the residency "
                 "manager; its resident pages are faulted again before use", slot.model.id, slot.device,
                 frees - slot.frees)
        slot.unseen_frees(self.session.ledger.resident(r), frees)
        if slot.hold is not None:
            slot.hold.ended_by_manager("pages freed past the residency manager")

    def own_free(self, slot: Slot, r: Reservation, before: int) -> None:
        """The manager's own free (or release) of ``r`` ran, its page map followed it, and the session's count
        was ``before`` ahead of it: the count moved by one (it reached the backend) or not at all; more is a
        free made past the manager at the same time (:meth:`sync`)."""
        now = self.frees.get(r.id, 0)
        if now <= before + 1:
            slot.frees = now
        else:
            self.unseen(slot, r)
