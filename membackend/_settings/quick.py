"""The start-up path: the values :func:`~.model.load_settings` gives, without importing pydantic.

The ComfyUI adapter's prestartup script runs before ComfyUI imports torch, and
importing pydantic costs about 0.3 s there. :func:`quick_settings` reads the
same sources (:class:`~.sources.Sources`) and resolves them with the same
rules (:func:`~.sources.resolve`): the values, the sources and the errors are
the ones :func:`load_settings` gives, because they are made by the same code.
Only the container differs: a :class:`QuickSettings` (plain attributes)
instead of the pydantic :class:`Settings`. Machine overrides are the one case
that needs the models (the machine code takes a ``MachineOverrides``): then
the :class:`Settings` of the same resolution is returned.
"""

from __future__ import annotations

from typing import Any

from .rules import FIELD_NAMES, MACHINE_FIELDS
from .sources import Resolved, Sources, resolve

__all__ = ["QuickSettings", "quick_settings"]

_MACHINE_NAMES = tuple(f.name for f in MACHINE_FIELDS)


class _NoMachineOverrides:
    """``MachineOverrides()`` -- no fact overridden -- without pydantic: what :class:`QuickSettings` has as
    ``machine``. Its fields are None and ``model_dump(exclude=..., exclude_none=...)`` answers as the model's
    does; anything else is answered by a real ``MachineOverrides()``."""

    def __getattr__(self, name: str) -> Any:
        if name in _MACHINE_NAMES:
            return None
        if name.startswith("__"):
            raise AttributeError(name)
        from .model import models

        return getattr(models()[1](), name)

    def model_dump(self, *, exclude: Any = None, exclude_none: bool = False, **other: Any) -> dict[str, Any]:
        if other:
            from .model import models

            return models()[1]().model_dump(exclude=exclude, exclude_none=exclude_none, **other)
        if exclude_none:
            return {}
        return {k: None for k in _MACHINE_NAMES if not (exclude and k in exclude)}

    def __repr__(self) -> str:
        return "MachineOverrides(" + ", ".join(f"{k}=None" for k in _MACHINE_NAMES) + ")"


class QuickSettings:
    """The values :func:`load_settings` gives, read without pydantic (see :func:`quick_settings`).

    Every field of :class:`Settings` is an attribute with the same value (``machine`` overrides nothing);
    :meth:`source_of` and :meth:`snapshot` answer as the model's do. Anything else a caller asks for
    (``model_dump``, ``model_fields``, ...) is answered by the equal :class:`Settings` that :meth:`full`
    builds on first such use."""

    def __init__(self, values: dict[str, Any], given: frozenset[str] = frozenset(), *,
                 origins: dict[str, str] | None = None, sources: Sources | None = None):
        self.__dict__.update({k: v for k, v in values.items() if k != "machine"})
        self.machine = _NoMachineOverrides()
        self._given = frozenset(given)  # the fields a source set (the model's ``model_fields_set``)
        self._origins = dict(origins or {})
        self._sources = sources
        self._full: Any = None

    def source_of(self, key: str) -> str:
        """Where the value of ``key`` came from (see ``Settings.source_of``)."""
        return self._origins.get(key, "default")

    def snapshot(self) -> Sources | None:
        """The sources these values were read from (see ``Settings.snapshot``)."""
        return self._sources

    def full(self) -> Any:
        """The equal :class:`Settings`, made from these values alone: they passed the rules already, and
        the environment or the files may have changed since."""
        if self._full is None:
            from .model import construct

            values = {k: getattr(self, k) for k in FIELD_NAMES if k != "machine"}
            self._full = construct(Resolved({**values, "machine": {}}, self._origins, self._given,
                                            self._sources))
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_given", "_origins", "_sources"):
            raise AttributeError(name)
        return getattr(self.full(), name)

    def __repr__(self) -> str:
        return "QuickSettings(" + " ".join(f"{k}={getattr(self, k)!r}" for k in FIELD_NAMES) + ")"


def quick_settings() -> Any:
    """What ``load_settings()`` gives -- the same values, sources and ``ConfigError`` -- without importing
    pydantic, unless machine overrides are set. Returns a :class:`QuickSettings`, or, with machine
    overrides, the :class:`Settings` of the same reading."""
    resolved = resolve(Sources.read())
    if resolved.values["machine"]:
        from .model import construct

        return construct(resolved)
    return QuickSettings(resolved.values, resolved.given, origins=resolved.origins, sources=resolved.sources)
