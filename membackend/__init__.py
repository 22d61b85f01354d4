"""membackend: a pluggable memory-backend layer for ComfyUI's dynamic VRAM.

What you may import, by who you are (everything else is internal):

**Callers** (code that reserves and backs memory, like the ComfyUI adapter)
    ``membackend`` itself::

        from membackend import create_session
        session = create_session()            # settings from env / files, kwargs win
        r = session.reserve("cpu", 1 << 30)
        f = session.fault(r, 0, 64 << 20)      # f.ok False means out of memory
        session.free(r)                        # fences first
        session.release_reservation(r)

    ``create_session`` returns a :class:`Session`; :class:`ResidencyManager` is
    the policy over one (models, pins, eviction by budget, full unload);
    :func:`load_settings` reads the settings the way ``create_session`` does.
    The value types and errors (:class:`Device`, :class:`Budget`, ...,
    :class:`MembackendError` and its subclasses) are re-exported here from
    :mod:`membackend.types` (its ``__all__``). The lab's errors are the lab's
    (``from membackend.lab import ReplayError``) and the installer's are internal:
    their old names here still work for one release, with a ``DeprecationWarning``.

**Backend authors** (a new mechanism: one class with the six verbs)
    :mod:`membackend.hookspec` (``hookimpl`` and the contract of every hook),
    :mod:`membackend.types` (the records a hook takes and returns, the errors it
    raises), and the conformance kit :mod:`membackend.testing`.

**Platform authors** (a new platform for the generic virtual-memory backend)
    :mod:`membackend.platform` (the ``Platform`` record, ``GENERIC`` as its
    example, the helpers a probe uses) plus :mod:`membackend.types` and the kit.

**Benchmark writers** (the repository's ``benchmarks/``, a plugin's comparison)
    the lab, :mod:`membackend.lab` (tooling: may change in any version): sessions
    on simulated machines, the stock comfy-aimdo models, a real GPU's pieces,
    the suite ``membackend bench`` runs (:mod:`membackend.lab.bench`), the
    replays and their pictures.

**Internal** (may change without notice; each has its test in ``tests/``)
    every module whose name starts with ``_``: ``_session``, ``_manager``,
    ``_residency``, ``_ledger``, ``_fences``, ``_trace``, ``_settings``,
    ``_machine``, ``_hostmem``, ``_tensors``, ``_cli``, and the packages
    ``_backends`` (host, vmm, aimdo), ``_drivers`` (real and simulated drivers,
    discovery, the one opener) and ``_comfyui`` (the ComfyUI adapter, started by
    the custom node ``membackend comfyui install`` writes).

The layers, and the module-by-module table with each module's test, are in the
project's ``docs/architecture.md`` and ``docs/modules.md``.
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__  # noqa: E402
from .hookspec import hookimpl  # noqa: E402
from .types import *  # noqa: E402,F401,F403
from .types import _MOVED, _moved_error  # noqa: E402
from .types import __all__ as _types_all  # noqa: E402

if TYPE_CHECKING:  # what a type checker sees of the lazy names below (the same objects, imported eagerly)
    from ._residency import ResidencyManager as ResidencyManager
    from ._residency import ResidencyPolicy as ResidencyPolicy
    from ._session import Session as Session
    from ._settings import load_settings as load_settings
    from .types import CannotWrite as CannotWrite  # the moved errors' old names, for their last release
    from .types import ForeignFolder as ForeignFolder
    from .types import NotComfyUI as NotComfyUI
    from .types import PlotFormatError as PlotFormatError
    from .types import PlotUnavailable as PlotUnavailable
    from .types import PluginMissing as PluginMissing
    from .types import ReplayError as ReplayError
    from .types import StartupCostError as StartupCostError
    from .types import TimelineError as TimelineError
    from .types import TraceError as TraceError
    from .types import TraceWriteError as TraceWriteError
    from .types import UnknownScenario as UnknownScenario
    from .types import UnsafeLayout as UnsafeLayout

#: names re-exported lazily (importing them pulls in the session, the policy or pydantic)
_LAZY = {
    "Session": ("._session", "Session"),
    "ResidencyManager": ("._residency", "ResidencyManager"),
    "ResidencyPolicy": ("._residency", "ResidencyPolicy"),
    "load_settings": ("._settings", "load_settings"),
}


def create_session(**settings: Any) -> "Session":
    """Discover backends, select one by the settings (kwargs win) and return a :class:`Session`."""
    from ._manager import create_session as _create

    return _create(**settings)


if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name is an error there and not Any

    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            import importlib

            module, attr = _LAZY[name]
            value = getattr(importlib.import_module(module, __name__), attr)
            globals()[name] = value
            return value
        if name in _MOVED:  # the lab's and the installer's errors: their old name here, for one release
            return _moved_error(__name__, name)  # not kept in globals(): each use warns
        raise AttributeError(f"module 'membackend' has no attribute {name!r}")


__all__ = ["__version__", "hookimpl", "create_session", *_LAZY, *_types_all]
