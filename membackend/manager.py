"""Discovery, validation and selection of backends.

Backends come from the built-ins (``host``) and the entry-point group
``membackend.backends``. Each is validated (a unique name; all six verbs and
``membackend_probe`` as hookimpls with the contract's parameter names). A
plugin that fails to import, to construct, to validate or to probe is logged
with the reason and skipped; it never stops the caller.

Selection: ``MEMBACKEND_DISABLE`` switches everything off; a forced name
(``MEMBACKEND_BACKEND``) wins, and an unknown one raises ``BackendNotFound``
listing what is available and why the rest is not; otherwise the highest
probe score wins, and a tie at the top is an error naming both. Blocked names
are never selected; ``host`` (score 1) is the fallback and cannot be blocked.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import pluggy

from . import hookspec
from .backends.host import HostBackend
from .ledger import Ledger
from .machine import machine_for
from .session import Session
from .settings import NAME_PATTERN, Settings, load_settings
from .types import BackendDisabled, BackendNotFound, Candidate, Capabilities, Machine, PluginError

log = logging.getLogger(__name__)

__all__ = ["BackendManager", "PluginRecord", "Selection", "ENTRY_POINT_GROUP", "create_session"]

ENTRY_POINT_GROUP = "membackend.backends"
FALLBACK = "host"


@dataclass
class PluginRecord:
    """A backend that loaded and validated."""

    name: str
    plugin: Any
    version: str
    origin: str
    capabilities: Capabilities


@dataclass
class Selection:
    """The outcome of selection, with everything the doctor explains."""

    record: PluginRecord | None
    how: str  # "forced", "auto", "fallback", "disabled"
    reason: str
    candidates: dict[str, Candidate] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)


def _spec_params(name: str) -> list[str]:
    return list(inspect.signature(getattr(hookspec, name)).parameters)


def validate_plugin(plugin: Any) -> str:
    """Return the plugin's name, or raise ``PluginError`` saying what breaks the contract."""
    name = getattr(plugin, "name", None)
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        raise PluginError(f"needs a `name` attribute matching {NAME_PATTERN}, has {name!r}")
    problems = []
    for hook in hookspec.HOOKS:
        fn = getattr(plugin, hook, None)
        if fn is None:
            problems.append(f"missing {hook}")
            continue
        if not callable(fn) or getattr(fn, f"{hookspec.PROJECT}_impl", None) is None:
            problems.append(f"{hook} is not marked with membackend.hookimpl")
            continue
        params = [p for p in inspect.signature(fn).parameters]
        if params != _spec_params(hook):
            problems.append(f"{hook}({', '.join(params)}) should be {hook}({', '.join(_spec_params(hook))})")
    caps = getattr(plugin, "capabilities", None)
    if caps is not None and not isinstance(caps, Capabilities):
        problems.append(f"capabilities must be a membackend.Capabilities, is {type(caps).__name__}")
    if problems:
        raise PluginError("; ".join(problems))
    return name


def _instantiate(obj: Any, settings: Settings) -> Any:
    """Entry points may name a class (built with ``from_settings`` or no arguments), an instance or a module."""
    if isinstance(obj, type):
        factory = getattr(obj, "from_settings", None)
        return factory(settings) if callable(factory) else obj()
    return obj


class BackendManager:
    """Loads every backend once; ``select`` and ``session`` may be called many times."""

    def __init__(self, settings: Settings | None = None, *, builtins: Iterable[Any] | None = None,
                 entry_points: Iterable[Any] | None = None):
        self.settings = settings or load_settings()
        self.records: dict[str, PluginRecord] = {}
        self.broken: dict[str, str] = {}
        self._pm = pluggy.PluginManager(hookspec.PROJECT)
        self._pm.add_hookspecs(hookspec)
        for plugin in builtins if builtins is not None else self._builtins():
            self._add(plugin, "built-in", None)
        eps = entry_points if entry_points is not None else importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in eps:
            self._load_entry_point(ep)

    # ------------------------------------------------------------------ discovery

    def _builtins(self) -> list[Any]:
        """host (the fallback), the generic VMM and comfy-aimdo; none touches a GPU until used."""
        from .backends.aimdo import AimdoBackend
        from .backends.vmm import VmmBackend

        return [HostBackend.from_settings(self.settings), VmmBackend.from_settings(self.settings),
                AimdoBackend.from_settings(self.settings)]

    def _load_entry_point(self, ep: Any) -> None:
        label = f"entry point {ep.name} = {ep.value}"
        try:
            plugin = _instantiate(ep.load(), self.settings)
        except Exception as exc:  # a broken plugin is never fatal
            self._broken(ep.name, f"failed to load ({label}): {type(exc).__name__}: {exc}")
            return
        dist = getattr(ep, "dist", None)
        self._add(plugin, label, getattr(dist, "version", None))

    def _add(self, plugin: Any, origin: str, dist_version: str | None) -> None:
        try:
            name = validate_plugin(plugin)
        except PluginError as exc:
            label = getattr(plugin, "name", None) or getattr(plugin, "__name__", None) or type(plugin).__name__
            self._broken(str(label), f"breaks the contract ({origin}): {exc}")
            return
        if name in self.records:
            self._broken(f"{name} ({origin})", f"name {name!r} is already used by {self.records[name].origin}")
            return
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:  # pluggy's own validation
            self._broken(name, f"breaks the contract ({origin}): {exc}")
            return
        version = str(getattr(plugin, "version", None) or dist_version or "unknown")
        caps = getattr(plugin, "capabilities", None) or Capabilities()
        self.records[name] = PluginRecord(name, plugin, version, origin, caps)

    def _broken(self, name: str, reason: str) -> None:
        log.warning("membackend: backend %s skipped: %s", name, reason)
        self.broken[name] = reason

    # ------------------------------------------------------------------ selection

    def probe(self, machine: Machine) -> tuple[dict[str, Candidate], dict[str, str]]:
        """Every usable backend's candidate, and the ones whose probe failed (name → reason)."""
        candidates: dict[str, Candidate] = {}
        failed: dict[str, str] = {}
        for name, rec in self.records.items():
            try:
                c = rec.plugin.membackend_probe(machine=machine)
                if not isinstance(c, Candidate) or not isinstance(c.score, int) or c.score < 0:
                    raise PluginError(f"probe must return a Candidate with an int score >= 0, returned {c!r}")
                if c.name != name:
                    c = Candidate(name, c.score, c.reason)
            except Exception as exc:
                failed[name] = f"probe raised {type(exc).__name__}: {exc}"
                log.warning("membackend: backend %s skipped: %s", name, failed[name])
                continue
            candidates[name] = c
        return candidates, failed

    def select(self, machine: Machine | None = None) -> Selection:
        machine = machine or machine_for(self.settings)
        s = self.settings
        blocked = [n for n in s.block if n != FALLBACK]
        if s.disable:
            return Selection(None, "disabled", "MEMBACKEND_DISABLE is set: callers use their legacy path",
                             broken=dict(self.broken), blocked=blocked)
        candidates, failed = self.probe(machine)
        broken = {**self.broken, **failed}
        for name in blocked:
            if name not in self.records and name not in broken:
                log.warning("membackend: block names %r, which is not an installed backend", name)
        if s.backend:
            rec = self.records.get(s.backend)
            if rec is None or s.backend in failed or s.backend in blocked:
                unavailable = dict(broken)
                unavailable.update({n: f"does not fit: {c.reason}" for n, c in candidates.items() if c.score == 0})
                unavailable.update({n: "blocked by MEMBACKEND_BLOCK" for n in blocked if n in self.records})
                available = [n for n in candidates if n not in unavailable]
                raise BackendNotFound(s.backend, available, unavailable)
            c = candidates[s.backend]
            note = "" if c.score > 0 else f"; its probe says it does not fit: {c.reason}"
            return Selection(rec, "forced", f"forced by backend={s.backend!r}{note}", candidates, broken, blocked)
        usable = {n: c for n, c in candidates.items() if c.score > 0 and n not in blocked}
        top = max((c.score for c in usable.values()), default=0)
        best = sorted(n for n, c in usable.items() if c.score == top)
        if len(best) > 1:
            raise PluginError(
                f"backends {' and '.join(repr(n) for n in best)} tie with score {top}; "
                f"choose one with MEMBACKEND_BACKEND={best[0]} (or block the other with MEMBACKEND_BLOCK)"
            )
        if not best or best[0] == FALLBACK:
            rec = self.records.get(FALLBACK) or self._fallback()
            why = "no other backend fits this machine" if len(self.records) > 1 else "no other backend is installed"
            return Selection(rec, "fallback", f"{FALLBACK}: {why}", candidates, broken, blocked)
        return Selection(self.records[best[0]], "auto", f"highest probe score ({top}): {usable[best[0]].reason}",
                         candidates, broken, blocked)

    def _fallback(self) -> PluginRecord:
        plugin = HostBackend.from_settings(self.settings)
        rec = PluginRecord(FALLBACK, plugin, plugin.version, "built-in", plugin.capabilities)
        self.records[FALLBACK] = rec
        return rec

    def session(self, machine: Machine | None = None, observers: Iterable[Any] = ()) -> Session:
        """A session on the selected backend. Raises ``BackendDisabled`` when switched off."""
        machine = machine or machine_for(self.settings)
        sel = self.select(machine)
        if sel.record is None:
            raise BackendDisabled(sel.reason)
        obs = list(observers)
        if self.settings.trace is not None:
            from .trace import TraceObserver

            obs.append(TraceObserver(self.settings.trace))
        return Session(sel.record.plugin, machine=machine, ledger=Ledger(sanitize=self.settings.sanitize),
                       observers=obs, headroom=self.settings.headroom,
                       candidate=sel.candidates.get(sel.record.name), how=sel.how)


def create_session(**settings: Any) -> Session:
    """Load settings (kwargs win), discover backends and return a session on the selected one."""
    return BackendManager(load_settings(**settings)).session()

