"""A :class:`Session`: one selected backend, its ledger and its observers.

The session is what callers use. It checks every argument before the backend
sees it (so every backend gets the same typed errors and the ledger never
changes on a bad call), keeps the fence tokens recorded on each reservation,
fences before every free and release (G2), and keeps the ledger.

The hot verbs (``fault``, ``free``) are bound once: with no observer wrapping
a verb, the session calls the backend's method directly instead of going
through pluggy's generic dispatch; with observers, it calls a hook caller that
holds only this backend and those observers. Observers may only wrap
(``wrapper=True`` or ``hookwrapper=True`` hookimpls): a plain hookimpl could
answer in the backend's place, so it is refused.

**A package of parts.** :class:`Session` (:mod:`.session`) is the front: the
public verbs over parts that :func:`.parts.compose` builds in one place (the
table of parts is :mod:`.parts`'). No part imports or holds the front: each
receives the callables it uses; every module stays under 300 lines
(``tests/test_session_parts.py``).
"""

from __future__ import annotations

from ..platform import HEADROOM_LIVE
from .checks import MAX_RESERVATION
from .fencing import FENCE_WAIT
from .permits import Permits as _Permits  # noqa: F401  (the tests hold the permits under this name)
from .session import Session

__all__ = ["Session", "MAX_RESERVATION", "HEADROOM_LIVE", "FENCE_WAIT"]
