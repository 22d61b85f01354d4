"""Binding: each verb of the backend, as the session calls it for a list of observers.

With no observer wrapping a verb, the bound verb is the backend's own method (no pluggy on the way); with
observers, a hook caller that holds only this backend and those observers. Observers may only wrap
(``wrapper=True`` or ``hookwrapper=True`` hookimpls): a plain hookimpl could answer in the backend's place, so
it is refused. The hot verbs' bodies over the bound verbs are :mod:`.hot`'s.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from .. import hookspec
from ..types import PluginError

#: argument names of each verb, in order, from the hookspecs themselves
ARGNAMES: dict[str, tuple[str, ...]] = {
    verb: tuple(inspect.signature(getattr(hookspec, verb)).parameters) for verb in hookspec.VERBS
}


@dataclass(frozen=True)
class Bound:
    """The verbs as bound for :attr:`observers` (each the backend's method or a hook caller through them), and
    each optional hook's function (None where the backend has none)."""

    reserve: Callable[..., Any]
    fault: Callable[..., Any]
    free: Callable[..., Any]
    release_reservation: Callable[..., Any]
    fence: Callable[..., Any]
    budget_query: Callable[..., Any]
    trim: Callable[..., Any] | None
    inspect: Callable[..., Any] | None
    inject_failures: Callable[..., Any] | None
    close: Callable[..., Any] | None
    observers: tuple[Any, ...]
    pm: pluggy.PluginManager


def bind(backend: Any, name: str, observers: list[Any]) -> Bound:
    """Every verb of ``backend`` (named ``name``) bound for ``observers``; ``PluginError`` for an observer that
    cannot be registered or has a plain hookimpl (nothing is bound then)."""
    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    pm.register(backend, name=f"backend:{name}")
    for i, obs in enumerate(observers):
        label = f"observer {type(obs).__name__} (#{i})"
        try:
            pm.register(obs, name=f"observer:{i}:{type(obs).__name__}")
        except Exception as exc:
            raise PluginError(f"{label} cannot be registered: {exc}") from exc
        for caller in pm.get_hookcallers(obs) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is obs and not (impl.wrapper or impl.hookwrapper):
                    raise PluginError(
                        f"{label} implements {caller.name} as a plain hookimpl, which could answer in the "
                        f"backend's place; accepted: observers mark every hookimpl @hookimpl(wrapper=True)")
    verbs: dict[str, Any] = {}
    for verb in hookspec.VERBS:
        caller = getattr(pm.hook, verb)
        wrapped = any(impl.plugin is not backend for impl in caller.get_hookimpls())
        verbs[verb.removeprefix("membackend_")] = _through(caller, ARGNAMES[verb]) if wrapped else getattr(backend, verb)
    for hook in hookspec.OPTIONAL_HOOKS:
        impls = [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin is backend]
        verbs[hook.removeprefix("membackend_")] = impls[0].function if impls else None
    return Bound(**verbs, observers=tuple(observers), pm=pm)


def _through(caller: Any, argnames: tuple[str, ...]) -> Callable[..., Any]:
    """A hook caller called with the verb's positional arguments (pluggy takes keywords only)."""
    def call(*args: Any) -> Any:
        return caller(**dict(zip(argnames, args)))
    return call
