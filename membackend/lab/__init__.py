"""The lab: membackend's tooling for benchmarks, comparisons, replays and checks on real GPUs.

**Tooling: may change in any version.** Nothing here is covered by the CHANGELOG's promise
(CHANGELOG.md names the public names it covers); the conformance kit a backend is checked by is
:mod:`membackend.testing`, and the ComfyUI adapter imports nothing from here. Nothing here needs
pytest.

Builders, imported on first use from their modules:

* :func:`simulated_session` ``(profile, platform=None, *, backend=None, driver=None,
  capabilities=None, page_size=None, machine=None, observers=(), **settings)`` — the one builder of
  sessions on simulated machines: a session over a fresh simulation of a profile (``wddm-6gb``,
  ``rocm-win-2gpu``, ``gb10-128gb``, ``h200``, ...), on the generic VMM backend with the profile's
  knobs, a plugin's ``platform``, a variant ``driver`` or a ``backend`` built by the caller, with its
  own ledger; ``membackend.ResidencyManager(session)`` puts the residency policy on it;
* :func:`host_session` ``(*, capacity=None, headroom=None, page_size=None, observers=(),
  **settings)`` — a session on the host backend (this process's memory, nothing simulated);
* :func:`simulated_driver`, :func:`simulated_machine`, :func:`simulated_profiles`,
  :func:`simulated_failures` — a profile's driver (or a variant of it), its machine facts, the
  profile names, the exceptions that end a simulated machine
  (all of these: :mod:`membackend.lab.simulated`);
* :class:`StockManager`, :class:`AimdoStockVmm`, :class:`AimdoLoadManager` — the stock models:
  membackend's models of stock ComfyUI + comfy-aimdo 0.5.x, the stock side of every comparison and
  of ``membackend replay`` (the managers' old names, ``StockPolicy`` and ``AimdoLoadPolicy``, still
  work for one release, with a ``DeprecationWarning``);
* :func:`this_machine`, :func:`cuda_driver`, :func:`vmm_backend`, :func:`aimdo_backend`,
  :func:`event_token`, :func:`tensor_at` — what a check on a real GPU needs
  (:mod:`membackend.lab.real`).

The lab's errors, all under :class:`membackend.MembackendError` (their home is here; the old
``membackend.X`` and ``membackend.types.X`` give the same classes for one release, with a
``DeprecationWarning``):

* :class:`ReplayError` — a replay that cannot run as asked, and its :class:`PluginMissing` (the
  plugin a comparison needs is not installed); :class:`UnknownScenario` — no built-in scenario of
  that name;
* :class:`TraceError` — a trace that cannot be replayed (the file, the line, what is wrong);
  :class:`TraceWriteError` — a trace that cannot be written (``replay --record``);
* :class:`TimelineError` — a tally the timeline cannot take;
* :class:`PlotUnavailable` — matplotlib is not installed; :class:`PlotFormatError` — no picture
  format for the path's suffix;
* :class:`StartupCostError` — the adapter's start-up cost cannot be measured here.

Modules:

* :mod:`membackend.lab.bench` — the suite ``membackend bench`` runs, and :func:`~membackend.lab.bench.replay`
  for benchmark scripts;
* :mod:`membackend.lab.startup_cost` — what the ComfyUI adapter adds to ComfyUI's start-up;
* :mod:`membackend.lab.adapter` — the adapter's per-call paths timed (the warm path, file reads);
* the replays (``membackend replay``: the seed reports as scenarios, the trace reader, the engine) and
  their pictures live in the lab's internal ``_replay`` and ``_pictures``.
"""

from typing import TYPE_CHECKING, Any

from .._lazy import lazy_attributes

# the lab's errors: defined in membackend.types, where every error class is and below the replays that raise
# them (see its "errors promised elsewhere"), and public here, their home; imported now, as they are cheap
from ..types import _PlotFormatError as PlotFormatError
from ..types import _PlotUnavailable as PlotUnavailable
from ..types import _PluginMissing as PluginMissing
from ..types import _ReplayError as ReplayError
from ..types import _StartupCostError as StartupCostError
from ..types import _TimelineError as TimelineError
from ..types import _TraceError as TraceError
from ..types import _TraceWriteError as TraceWriteError
from ..types import _UnknownScenario as UnknownScenario

if TYPE_CHECKING:  # what a type checker sees of the names below: the same objects, imported eagerly
    from .real import aimdo_backend as aimdo_backend
    from .real import cuda_driver as cuda_driver
    from .real import event_token as event_token
    from .real import tensor_at as tensor_at
    from .real import this_machine as this_machine
    from .real import vmm_backend as vmm_backend
    from .simulated import AimdoLoadManager as AimdoLoadManager
    from .simulated import AimdoLoadPolicy as AimdoLoadPolicy  # the old names, for their last release
    from .simulated import AimdoStockVmm as AimdoStockVmm
    from .simulated import StockManager as StockManager
    from .simulated import StockPolicy as StockPolicy
    from .simulated import host_session as host_session
    from .simulated import simulated_driver as simulated_driver
    from .simulated import simulated_failures as simulated_failures
    from .simulated import simulated_machine as simulated_machine
    from .simulated import simulated_profiles as simulated_profiles
    from .simulated import simulated_session as simulated_session

#: where each name lives: imported on first use, so ``import membackend.lab.bench`` builds no session machinery
_HOME = {
    "simulated_session": "simulated", "host_session": "simulated", "simulated_driver": "simulated",
    "simulated_machine": "simulated", "simulated_profiles": "simulated", "simulated_failures": "simulated",
    "StockManager": "simulated", "AimdoStockVmm": "simulated", "AimdoLoadManager": "simulated",
    "this_machine": "real", "cuda_driver": "real", "vmm_backend": "real", "aimdo_backend": "real",
    "event_token": "real", "tensor_at": "real",
}

__all__ = ["simulated_session", "host_session", "simulated_driver", "simulated_machine", "simulated_profiles",
           "simulated_failures", "StockManager", "AimdoStockVmm", "AimdoLoadManager", "this_machine", "cuda_driver",
           "vmm_backend", "aimdo_backend", "event_token", "tensor_at",
           # the lab's errors, imported above
           "ReplayError", "PluginMissing", "UnknownScenario", "TraceError", "TraceWriteError", "TimelineError",
           "PlotUnavailable", "PlotFormatError", "StartupCostError"]

if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name is an error there and not Any
    _lazy = lazy_attributes(__name__, {name: f".{home}" for name, home in _HOME.items()}, globals())

    def __getattr__(name: str) -> Any:
        if name in ("StockPolicy", "AimdoLoadPolicy"):  # the managers' old names: not kept, each use warns
            from ._replay.stock import renamed

            return renamed(__name__, name)
        return _lazy(name)
