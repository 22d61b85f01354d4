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
gives memory back (ROCm 7.2), whether a fault may shed the model's own pages,
whether a full unload keeps the reservation, and what runs each full unload (its hook
``full_unload_of``, told why the unload happens). Today's ComfyUI + comfy-aimdo
behaviour, reproduced for side-by-side comparison, is such a policy in the lab
(``membackend.lab._replay.stock``): policy code here stays free of comparison models.

The parts, each under the manager's lock: ``slots`` (a reservation's page map, :class:`Slot`), ``model``
(:class:`Model`, the checks of a registration), ``policy`` (:class:`ResidencyPolicy`), ``registry`` (what the
parts share: the models, the run, the clock, the lock, the session, the policy, the tracer), ``warm``
(:class:`WarmRange`), ``holds`` (:class:`~.holds.Hold`), ``loads`` (the load records), ``content`` (content
tags and the cache of dropped models), ``faulting``, ``eviction`` and ``unloading`` (the manager's verbs past
their checks), and ``manager`` (:class:`ResidencyManager`, the front), which composes the others over one
registry. No other module of the package imports the manager: a part gets the registry and the callables of
the other parts it uses.
"""

from ..types import ModelError
from .manager import ResidencyManager
from .model import Model, ModelKind, Unloaded
from .policy import ResidencyPolicy
from .warm import WarmRange

__all__ = ["ModelKind", "Model", "ModelError", "ResidencyManager", "ResidencyPolicy", "Unloaded", "WarmRange"]
