"""Discovery, validation and selection of backends.

Backends come from the built-ins (``host``, the generic ``vmm`` platform,
``aimdo``) and the entry-point group ``membackend.backends``, whose entries
name a backend object, a class (built with ``from_settings(settings)`` when it
has one, else with no arguments) or a :class:`~membackend.platform.Platform`
(built into a :class:`~membackend._backends.vmm.VmmBackend`, which reads the
settings the platform declares from the same sources as the settings). A bad
value of a setting a plugin declares is a settings error like any other: the
``ConfigError`` (the key, the source, what is accepted) is raised, not the
plugin listed as broken, since selecting another backend would quietly move the
user off the one they configured. So are a ``sim_profile`` no simulated machine
has (with every profile's name and the closest one) and a ``host_capacity``
above the RAM the host backend draws from. Each is
validated (a unique name; the six verbs and ``membackend_probe`` as
hookimpls with the contract's parameter names; optional hooks checked the
same way when present). A plugin that fails to import, to construct, to
validate or to probe — by raising anything, ``sys.exit()`` included, except
``KeyboardInterrupt`` and a ``ConfigError`` while it is built — is logged with
the reason and skipped; it never stops
the caller. A missing vendor runtime is no such failure: registering a
plugin runs none of its attributes (a lazy driver stays unopened), and a
probe that raises ``DriverError`` with code ``unavailable`` (the vendor's
library cannot be found, loaded or called) scores 0 with that reason.

Probes run once per machine through the plugin manager's hook machinery, one
plugin at a time (one raising probe never hides the others), each bounded by
the ``probe_timeout`` setting: a probe that does not answer in time is
skipped as broken.

Selection: ``MEMBACKEND_DISABLE`` switches everything off; a forced name
(``MEMBACKEND_BACKEND``) wins, and an unknown one raises ``BackendNotFound``
listing what is available and why the rest is not, and where the name was
set (``env MEMBACKEND_BACKEND``, a file's path); otherwise the highest
probe score wins (:class:`~membackend.types.Score`), passing over opt-in
candidates. A tie at the top never stops the caller: the alphabetically first
name wins, one warning says so, and the selection records the tie for the
doctor. Blocked names are never selected; ``host`` (score 1) is the fallback
and cannot be blocked.
"""

from __future__ import annotations

import errno
import importlib.metadata
import inspect
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

from . import hookspec
from ._backends import host as host_backend
from ._backends.host import HostBackend
from ._drivers.open import check_sim_profile, machine_for
from ._ledger import Ledger
from ._session import Session
from ._settings import NAME_PATTERN, load_settings
from ._settings.rules import FIELD_NAMES, FILES_ACCEPTED, out_of_files, quoted
from ._settings.sources import PlatformValues, Sources, platform_env_name, resolve_platform
from .platform import Platform, PlatformSetting, takes_parameter
from .types import (
    BackendDisabled,
    BackendNotFound,
    Candidate,
    Capabilities,
    ConfigError,
    DriverError,
    Machine,
    MembackendError,
    PluginError,
    Score,
    format_size,
)

if TYPE_CHECKING:  # naming the pydantic model at import would build it: start-up stays free of pydantic
    from ._settings import Settings

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
    #: the values of the settings the backend declares (a platform's, or a backend's own ``settings``)
    values: PlatformValues | None = None


@dataclass
class Selection:
    """The outcome of selection, with everything the doctor explains."""

    record: PluginRecord | None
    how: str  # "forced", "auto", "fallback", "disabled"
    reason: str
    candidates: dict[str, Candidate] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)  # names that shared the top score (the first won)
    #: the names forcing (the ``backend`` setting) would select on this machine, highest probe score first,
    #: and why each other is refused
    forceable: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


class _StaticPluginManager(pluggy.PluginManager):
    """pluggy's manager, finding a plugin's hookimpls without running its attributes.

    pluggy before 1.7 reads every attribute of a plugin it registers with ``getattr``, which runs properties:
    a ``VmmBackend``'s ``driver`` opens the vendor's driver there (``cuInit``; for HIP, loading the runtime),
    so on a machine without that vendor's runtime every platform of it failed to register and was shown as
    breaking the contract. Looking attributes up statically (``inspect.getattr_static``, as pluggy 1.7
    does) finds the same hookimpls on every pluggy this package accepts and runs nothing of the plugin's."""

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        try:
            found = inspect.getattr_static(plugin, name)
        except AttributeError:
            return None
        if isinstance(found, (staticmethod, classmethod)):
            found = found.__func__
        if not inspect.isroutine(found):
            return None
        opts = getattr(found, f"{self.project_name}_impl", None)
        return opts if isinstance(opts, dict) else None


def _runtime_missing(exc: BaseException) -> bool:
    """Whether a probe's exception says the vendor's runtime is not there: a ``DriverError`` whose call never
    ran (code ``unavailable``: the library cannot be found, loaded or called). That is a fact about the
    machine (the backend does not fit it, score 0), not a backend breaking the contract."""
    return isinstance(exc, DriverError) and exc.code == "unavailable"


def _spec_params(name: str) -> list[str]:
    return list(inspect.signature(getattr(hookspec, name)).parameters)


def validate_plugin(plugin: Any) -> str:
    """Return the plugin's name, or raise ``PluginError`` saying what breaks the contract."""
    name = getattr(plugin, "name", None)
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        raise PluginError(f"needs a `name` attribute matching {NAME_PATTERN}, has {name!r}")
    problems = []
    for hook in hookspec.HOOKS + hookspec.OPTIONAL_HOOKS:
        fn = getattr(plugin, hook, None)
        if fn is None:
            if hook in hookspec.HOOKS:
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


def declared_settings(obj: Any) -> tuple[PlatformSetting, ...]:
    """The settings a backend class or object declares (``settings``: ``PlatformSetting`` records, as a
    platform's), or () when it declares none. Raises ``PluginError`` for a ``settings`` tuple or list that
    holds anything else (a ``settings`` attribute of another kind is the backend's own business)."""
    declared = getattr(obj, "settings", ())
    if not isinstance(declared, (tuple, list)) or not declared:
        return ()
    if not all(isinstance(d, PlatformSetting) for d in declared):
        raise PluginError("settings must be membackend.platform.PlatformSetting records (or absent)")
    return tuple(declared)


def _source(settings: Any, key: str) -> str:
    """Where the value of setting ``key`` came from, as errors name it (``settings`` when it cannot say)."""
    source_of = getattr(settings, "source_of", None)
    return source_of(key) if callable(source_of) else "settings"


def check_profile(settings: Any) -> None:
    """Raise ``ConfigError`` (key ``sim_profile``, the source that set it) for a profile no simulated machine
    has: every profile's name, from the simulation's own table, and the closest one ("did you mean
    strix-halo-128gb?"). The settings take any text here (they sit below the simulation and cannot know)."""
    name = getattr(settings, "sim_profile", None)
    if name is None:
        return
    check_sim_profile(name, _source(settings, "sim_profile"))


def check_host_capacity(settings: Any) -> None:
    """Raise ``ConfigError`` (key ``host_capacity``) for a cap above the memory the host backend draws from
    (the machine's RAM, or its memory cgroup's limit): such a cap caps nothing, and its budget would claim
    memory that is not there (the self-test's budget check then fails). Said in human units."""
    cap = getattr(settings, "host_capacity", None)
    if cap is None:
        return
    mem = host_backend.host_memory()  # read as the host backend reads it for its budget
    if cap <= mem.total:
        return
    snapshot = getattr(settings, "snapshot", None)
    sources = snapshot() if callable(snapshot) else None
    found = sources.find("host_capacity") if sources is not None else None
    given = format_size(cap) if found is None or not isinstance(found[0], str) else \
        f"{quoted(found[0].strip())} ({format_size(cap)})"
    room = "RAM" if mem.total == mem.ram_total else "memory (its memory cgroup's limit)"
    raise ConfigError("host_capacity", _source(settings, "host_capacity"),
                      f"{given} is more than this machine's {format_size(mem.total)} of {room}",
                      f"a size of at most {format_size(mem.total)} ({mem.total} bytes), the {room} the host "
                      "backend draws from; or no setting, for no cap")


def _instantiate(obj: Any, settings: Settings) -> Any:
    """Entry points may name a Platform, a class (built with ``from_settings`` or no arguments), an
    instance or a module. A class that declares ``settings`` gets their values, read under its ``name``
    from the same sources as a platform's, as ``from_settings(settings, values=...)`` when that takes
    ``values`` (a bad value raises ``ConfigError``: the plugin is broken with its message)."""
    if isinstance(obj, Platform):
        from ._backends.vmm import VmmBackend

        return VmmBackend.from_settings(settings, obj)
    if isinstance(obj, type):
        factory = getattr(obj, "from_settings", None)
        if not callable(factory):
            return obj()
        if declared_settings(obj) and takes_parameter(factory, "values"):
            return factory(settings, values=backend_values(obj, settings))
        return factory(settings)
    return obj


def backend_values(obj: Any, settings: Any) -> PlatformValues | None:
    """The values of the settings backend ``obj`` declares (None: it declares none), read under its name."""
    declared = declared_settings(obj)
    if not declared:
        return None
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        raise PluginError(f"a backend that declares settings needs a name matching {NAME_PATTERN} to read them "
                          f"under, has {name!r}")
    clash = [platform_env_name(name, d.name) for d in declared
             if name in FIELD_NAMES or platform_env_name(name, d.name).removeprefix("MEMBACKEND_").lower()
             in FIELD_NAMES]
    if clash:  # as a platform's record refuses it (membackend.platform.Platform)
        raise PluginError(f"backend {name!r}: its settings would be read from {', '.join(clash)}, which "
                          "membackend's own settings use; rename the backend or the setting")
    snapshot = getattr(settings, "snapshot", None)
    sources = snapshot() if callable(snapshot) else None
    return resolve_platform(name, declared, sources if sources is not None else Sources.read())


class BackendManager:
    """Loads every backend once; ``select`` and ``session`` may be called many times."""

    def __init__(self, settings: Settings | None = None, *, builtins: Iterable[Any] | None = None,
                 entry_points: Iterable[Any] | None = None):
        self.settings = settings or load_settings()
        check_profile(self.settings)
        check_host_capacity(self.settings)
        self.records: dict[str, PluginRecord] = {}
        self.broken: dict[str, str] = {}
        self._probed: dict[Machine, tuple[dict[str, Candidate], dict[str, str]]] = {}
        self._warned_ties: set[tuple[str, ...]] = set()
        self._pm = _StaticPluginManager(hookspec.PROJECT)
        self._pm.add_hookspecs(hookspec)
        for plugin in builtins if builtins is not None else self._builtins():
            self._add(plugin, "built-in", None)
        eps = entry_points if entry_points is not None else importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in eps:
            self._load_entry_point(ep)

    # ------------------------------------------------------------------ discovery

    def _builtins(self) -> list[Any]:
        """host (the fallback), the generic VMM and comfy-aimdo; none touches a GPU until used."""
        from ._backends.aimdo import AimdoBackend
        from ._backends.vmm import VmmBackend
        from .platform import GENERIC

        return [HostBackend.from_settings(self.settings), VmmBackend.from_settings(self.settings, GENERIC),
                AimdoBackend.from_settings(self.settings)]

    def _load_entry_point(self, ep: Any) -> None:
        label = f"entry point {ep.name} = {ep.value}"
        try:
            plugin = _instantiate(ep.load(), self.settings)
        except (KeyboardInterrupt, ConfigError):  # a bad value of a setting it declares is the user's to fix:
            raise  # listing the plugin as broken would select another backend, and the typo would go unseen
        except BaseException as exc:  # a broken plugin is never fatal, sys.exit() included
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
        try:
            values = getattr(plugin, "platform_values", None) or backend_values(plugin, self.settings)
        except MembackendError as exc:
            self._pm.unregister(name=name)
            if isinstance(exc, ConfigError):  # a bad value of its settings: the user's to fix, as above
                raise
            self._broken(name, f"{origin}: {exc}")
            return
        self.records[name] = PluginRecord(name, plugin, version, origin, caps, values)

    def _broken(self, name: str, reason: str) -> None:
        log.warning("membackend: backend %s skipped: %s", name, reason)
        self.broken[name] = reason

    # ------------------------------------------------------------------ selection

    def probe(self, machine: Machine) -> tuple[dict[str, Candidate], dict[str, str]]:
        """Every usable backend's candidate, and the ones whose probe failed (name → reason).

        Probed once per machine: later calls return the same answers.
        """
        if machine not in self._probed:
            self._probed[machine] = self._probe_all(machine)
        candidates, failed = self._probed[machine]
        return dict(candidates), dict(failed)

    def _probe_all(self, machine: Machine) -> tuple[dict[str, Candidate], dict[str, str]]:
        timeout = self.settings.probe_timeout
        answers: dict[str, tuple[str, Any]] = {}

        def run(name: str) -> None:
            # the plugin's own hook caller: pluggy's machinery, isolated from every other plugin
            others = [rec.plugin for n, rec in self.records.items() if n != name]
            caller = self._pm.subset_hook_caller("membackend_probe", remove_plugins=others)
            try:
                results = caller(machine=machine)
                answers[name] = ("ok", results[0] if results else None)
            except KeyboardInterrupt:
                answers[name] = ("error", "KeyboardInterrupt")
            except BaseException as exc:  # SystemExit too: one plugin never stops the others
                if _runtime_missing(exc):  # the vendor's runtime is not on this machine: does not fit
                    answers[name] = ("ok", Candidate(name, Score.NONE, f"the vendor's runtime is missing: {exc}"))
                else:
                    answers[name] = ("error", f"probe raised {type(exc).__name__}: {exc}")

        threads = {name: threading.Thread(target=run, args=(name,), name=f"membackend-probe-{name}", daemon=True)
                   for name in self.records}
        for t in threads.values():
            t.start()
        for t in threads.values():  # all run at once: the whole probe takes at most one timeout
            t.join(timeout)
        candidates: dict[str, Candidate] = {}
        failed: dict[str, str] = {}
        for name in self.records:
            kind, value = answers.get(name, ("error", f"probe did not answer within {timeout:g} s "
                                                      "(the probe_timeout setting)"))
            if kind == "ok":
                c = value
                if not isinstance(c, Candidate) or not isinstance(c.score, int) or isinstance(c.score, bool) \
                        or c.score < 0:
                    kind, value = "error", f"probe must return a Candidate with an int score >= 0, returned {c!r}"
                else:
                    candidates[name] = c if c.name == name else Candidate(name, c.score, c.reason, c.opt_in)
                    continue
            failed[name] = value
            log.warning("membackend: backend %s skipped: %s", name, value)
        return candidates, failed

    def select(self, machine: Machine | None = None, *, anywhere: bool = False) -> Selection:
        """Choose the backend for ``machine`` (default: the machine the settings describe).

        In order: switched off by ``disable`` (no record); forced by the ``backend`` setting
        (``BackendNotFound`` saying why in one line when it is not installed, broken, blocked, or serves
        no device of ``machine``); else the highest probe score among the backends that fit, are
        not blocked and are not opt-in (ties: the first by name, warned once); else the ``host`` fallback.
        ``anywhere``: a forced backend that serves no device here is selected all the same (the
        conformance kit, whose rules then skip and say why); a user's forcing never is.
        """
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
        refused = self._refusals(machine if not anywhere else None, candidates, broken, blocked)
        sel = self._forced(s.backend, candidates, refused, broken, blocked) if s.backend else \
            self._by_score(candidates, broken, blocked)
        sel.refused = refused
        # best first: the doctor's "to force another" names the first (never one whose probe turned it down)
        sel.forceable = sorted((n for n in candidates if n not in refused), key=lambda n: (-candidates[n].score, n))
        return sel

    def _refusals(self, machine: Machine | None, candidates: dict[str, Candidate], broken: dict[str, str],
                  blocked: list[str]) -> dict[str, str]:
        """Why forcing each known backend would be refused, in words: broken, blocked, serving no device of
        ``machine``, or a probe that says it does not fit (with the probe's reason). ``machine`` None (the
        conformance kit) checks neither of the last two. A probe's "does not fit" is overridden only by the
        ``override_probe`` setting: a forced backend the probe turned down fails later, and further from the
        cause (a self-test's budget, a fault), so it is refused here with the reason and the way past it."""
        refused = {n: f"broken: {why}" for n, why in broken.items()}
        refused.update({n: "blocked by MEMBACKEND_BLOCK" for n in blocked if n in self.records})
        kinds = {"cpu", *(d.device.kind for d in machine.devices)} if machine is not None else None
        for n, c in candidates.items():
            served = tuple(getattr(self.records[n].plugin, "device_kinds", ()))
            if kinds is not None and n not in refused and c.score == Score.NONE and not kinds & set(served):
                refused[n] = (f"it serves {'/'.join(served) or 'no'} devices and this machine has none; "
                              f"its probe says: {c.reason}")
            elif kinds is not None and n not in refused and c.score == Score.NONE and not self.settings.override_probe:
                refused[n] = (f"its probe says it does not fit this machine: {c.reason}; to force it all the same, "
                              f"set MEMBACKEND_OVERRIDE_PROBE=1 (or override_probe = true in membackend.toml)")
        return refused

    def _forced(self, name: str, candidates: dict[str, Candidate], refused: dict[str, str],
                broken: dict[str, str], blocked: list[str]) -> Selection:
        """The selection the ``backend`` setting forces, or ``BackendNotFound`` in one line: a name not installed
        (with the closest installed one), or one of ``refused`` (:meth:`_refusals`) with its reason."""
        if name not in self.records or name in refused:
            err = BackendNotFound(name, sorted(n for n in candidates if n not in refused), refused)
            # BackendNotFound words what was asked and why it cannot be had; where the name was set (a typo
            # in membackend.toml is fixed there) only the settings know. Said last: the reason comes first
            # where the line is cut short (the ComfyUI adapter's start-up line)
            err.args = (f"{err}; the name is from {_source(self.settings, 'backend')}",)
            raise err
        c = candidates[name]
        note = "" if c.score > 0 else f"; its probe says it does not fit (overridden by override_probe): {c.reason}"
        return Selection(self.records[name], "forced", f"forced by backend={name!r}{note}", candidates, broken,
                         blocked)

    def _by_score(self, candidates: dict[str, Candidate], broken: dict[str, str],
                  blocked: list[str]) -> Selection:
        """The highest score among the usable candidates (ties: alphabetical, documented), else the fallback."""
        usable = {n: c for n, c in candidates.items() if c.score > Score.NONE and n not in blocked and not c.opt_in}
        top, best = _highest(usable)
        tied = best if len(best) > 1 else []
        if tied:
            self._warn_tie(tied, top)
        if not best or best[0] == FALLBACK:
            rec = self.records.get(FALLBACK) or self._fallback()
            why = "no other backend fits this machine" if len(self.records) > 1 else "no other backend is installed"
            return Selection(rec, "fallback", f"{FALLBACK}: {why}", candidates, broken, blocked, tied)
        why = f"highest probe score ({top}): {usable[best[0]].reason}"
        if tied:
            why += f" (tied with {', '.join(n for n in tied if n != best[0])}; the first by name wins)"
        return Selection(self.records[best[0]], "auto", why, candidates, broken, blocked, tied)

    def _warn_tie(self, tied: list[str], score: int) -> None:
        """Warn once per set of tied backends (a selection runs at every start and on every doctor)."""
        if tuple(tied) in self._warned_ties:
            return
        self._warned_ties.add(tuple(tied))
        log.warning("membackend: backends %s tie with score %d; %r wins (alphabetical); choose with "
                    "MEMBACKEND_BACKEND=<name> or block the others with MEMBACKEND_BLOCK",
                    " and ".join(repr(n) for n in tied), score, tied[0])

    def _fallback(self) -> PluginRecord:
        plugin = HostBackend.from_settings(self.settings)
        rec = PluginRecord(FALLBACK, plugin, plugin.version, "built-in", plugin.capabilities)
        self.records[FALLBACK] = rec
        return rec

    def session(self, machine: Machine | None = None, observers: Iterable[Any] = (),
                selection: Selection | None = None) -> Session:
        """A session on the selected backend (``selection`` when the caller already selected).
        Raises ``BackendDisabled`` when switched off."""
        machine = machine or machine_for(self.settings)
        sel = selection or self.select(machine)
        if sel.record is None:
            raise BackendDisabled(sel.reason)
        obs = list(observers)
        tracer = None
        source_of = getattr(self.settings, "source_of", None)  # the session owns the headroom setting
        if self.settings.trace is not None:
            from ._settings import quoted
            from ._trace import TraceObserver
            from .types import ConfigError

            try:  # what a replay on another machine needs to know about this one
                tracer = TraceObserver(self.settings.trace, backend=sel.record.name,
                                       sim_profile=self.settings.sim_profile,
                                       devices=[{"device": str(d.device), "name": d.name,
                                                 "total_memory": d.total_memory} for d in machine.devices])
            except OSError as exc:  # a full disk (/dev/full), a FIFO nobody reads: refused before any verb runs
                raise ConfigError("trace", source_of("trace") if callable(source_of) else "settings",
                                  f"cannot write the trace {quoted(str(self.settings.trace))}: {exc.strerror or exc}",
                                  "a path to a regular file (or a device such as /dev/null) that can be opened "
                                  "for appending, on a disk with room for it") from exc
            obs.append(tracer)
        try:
            return Session(sel.record.plugin, machine=machine, ledger=Ledger(sanitize=self.settings.sanitize),
                           observers=obs, headroom=self.settings.headroom,
                           headroom_source=source_of("headroom") if callable(source_of) else None,
                           candidate=sel.candidates.get(sel.record.name), how=sel.how, tracer=tracer)
        except BaseException:
            if tracer is not None:  # the session was not made: its trace file does not stay open
                tracer.close()
            raise


def _highest(usable: dict[str, Candidate]) -> tuple[int, list[str]]:
    """The highest score of ``usable`` (0 when empty) and the names that have it, sorted by name."""
    top = max((c.score for c in usable.values()), default=0)
    return top, sorted(n for n, c in usable.items() if c.score == top)


def create_session(**settings: Any) -> Session:
    """Load settings (kwargs win), discover backends and return a session on the selected one. A process with
    no file descriptor left gets a ``DriverError`` naming its open-file limit (``create_session``), not a bare
    ``OSError`` from whichever file it could not open."""
    try:
        return BackendManager(load_settings(**settings)).session()
    except OSError as exc:
        if isinstance(exc, MembackendError) or (why := out_of_files(exc)) is None:
            raise
        where = f"could not open {exc.filename!r}: " if exc.filename else ""
        raise DriverError(errno.errorcode.get(exc.errno or 0, exc.errno), "create_session",
                          f"{where}{why}; accepted: {FILES_ACCEPTED}") from exc

