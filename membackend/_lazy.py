"""Module ``__getattr__`` (PEP 562) makers: names a package imports on first use, and old names a module keeps for
one release.

The packages whose names live in submodules that are dear to import (``membackend.lab``, ``membackend.testing``)
use :func:`lazy_attributes`; modules whose names moved or were renamed (``membackend.types``, the lab's
managers) use :func:`old_names`.

:func:`lazy_attributes` ``(package, homes, namespace)`` returns that ``__getattr__``: a name of ``homes`` is
imported from its submodule on first use and kept in ``namespace`` (the package's globals), so the lookup runs
once per name; any other name raises ``AttributeError`` as a module does. A package defines it only where type
checkers do not look (``if not TYPE_CHECKING:``) and imports the same names for them under ``TYPE_CHECKING``, so
a checker sees each name's own type and a misspelt name is an error there, not ``Any``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_attributes", "old_names"]


def lazy_attributes(package: str, homes: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package`` (its dotted name) for the names of ``homes``, each mapped to the module
    that defines it, relative to the package (``".simulated"``)."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(homes[name], package), name)
        namespace[name] = value
        return value

    return __getattr__


def old_names(module: str, names: Container[str], give: Callable[[str, str], Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` (its dotted name) for the old ``names`` it keeps for one release: each
    is ``give(module, name)``, which warns (at ``stacklevel=3``, the line that used the name) and returns what the
    name stands for; any other name raises ``AttributeError`` as a module does. Not kept in the module's globals,
    so that each use warns."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return give(module, name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
