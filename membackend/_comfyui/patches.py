"""Reversible attribute patches: every replacement remembers the original and can be undone.

A patch is feature-detected: the name must exist where it is patched (a
``required`` patch on a missing name raises :class:`MissingName`; an optional
one is skipped and reported under its ``label``, e.g. the ComfyUI flag as a user
types it). :meth:`Patches.restore` puts every original back in reverse order,
carrying on past failures, and is idempotent. A ``surface`` patch (the facade
names ComfyUI's dynamic patchers call) can be left in place by an abort.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..types import MissingName

log = logging.getLogger("membackend")

__all__ = ["MissingName", "Patches"]

_ABSENT = object()


def _label(obj: Any, name: str) -> str:
    return f"{getattr(obj, '__name__', type(obj).__name__)}.{name}"


class Patches:
    """The adapter's patches, in the order they were made; safe to share between threads."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any, bool]] = []  # (object, name, what was there, surface)
        self.skipped: list[str] = []  # optional patches whose name this ComfyUI lacks
        self._lock = threading.RLock()

    def replace(self, obj: Any, name: str, value: Any, *, required: bool = True, surface: bool = False,
                label: str | None = None, requires: tuple[str, ...] = ()) -> bool:
        """Set ``obj.name = value``, remembering what was there; False when skipped (optional, absent).

        ``requires`` names other attributes of ``obj`` the replacement reads: the patch is applied only when
        ``obj`` has every one of them too (else it is missing as ``name`` is). ``obj`` may be None (a module
        or class this ComfyUI lacks): every name is missing there."""
        with self._lock:
            missing = [n for n in (name, *requires) if not hasattr(obj, n)]
            if missing:
                if required:
                    raise MissingName(f"{_label(obj, missing[0])} does not exist; this ComfyUI or comfy-aimdo is "
                                      "not one the adapter knows")
                self.skipped.append(label or _label(obj, name))
                return False
            own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else getattr(obj, name)
            setattr(obj, name, value)
            self._done.append((obj, name, own, surface))
            return True

    def original(self, obj: Any, name: str) -> Any:
        """What ``obj.name`` was before the first patch of it (the current value when unpatched)."""
        with self._lock:
            for o, n, own, _ in self._done:
                if o is obj and n == name:
                    return getattr(type(obj), name, None) if own is _ABSENT else own
        return getattr(obj, name)

    @property
    def applied(self) -> list[str]:
        with self._lock:
            return [_label(o, n) for o, n, _, _ in self._done]

    def restore(self, *, keep_surface: bool = False) -> list[str]:
        """Undo every patch, newest first; returns the ones that could not be undone (and logs them).

        ``keep_surface`` leaves the ``surface`` patches in place (and remembered, for a later restore)."""
        failed = []
        kept = []
        with self._lock:
            while self._done:
                obj, name, own, surface = entry = self._done.pop()
                if keep_surface and surface:
                    kept.append(entry)
                    continue
                try:
                    if own is _ABSENT:
                        delattr(obj, name)
                    else:
                        setattr(obj, name, own)
                except Exception as exc:
                    failed.append(f"{_label(obj, name)}: {exc}")
                    log.warning("membackend: could not restore %s: %s", _label(obj, name), exc)
            self._done = kept[::-1]
        return failed
