"""membackend: a pluggable memory-backend layer for ComfyUI's dynamic VRAM.

The public surface a caller needs::

    from membackend import create_session
    session = create_session()            # settings from env / files, kwargs win
    r = session.reserve("cpu", 1 << 30)
    f = session.fault(r, 0, 64 << 20)      # f.ok False means out of memory
    session.free(r)                        # fences first
    session.release_reservation(r)

A backend author needs :mod:`membackend.hookspec` (``hookimpl``) and the
records in :mod:`membackend.types`.
"""

from ._version import __version__  # noqa: E402
from .hookspec import hookimpl  # noqa: E402
from .types import *  # noqa: E402,F401,F403
from .types import __all__ as _types_all  # noqa: E402


def create_session(**settings):
    """Discover backends, select one by the settings (kwargs win) and return a :class:`Session`."""
    from ._manager import create_session as _create

    return _create(**settings)


__all__ = ["__version__", "hookimpl", "create_session", *_types_all]
