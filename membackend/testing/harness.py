"""What the conformance kit needs around a backend: a session on a target, an independent
view of what the platform holds, injected driver failures and asynchronous work to fence.

The kit trusts nothing the backend says about itself. It checks the session's
ledger against, in this order of preference:

* the kernel, for every backend that serves ``cpu`` devices (whose
  reservations are addresses in this process): ``/proc/self/maps`` for the
  ranges and ``mincore(2)`` for resident pages, after every ``fault``,
  ``free`` and ``release_reservation`` and after every step (Linux only);
* the driver's own view, from the optional hook ``membackend_inspect``.

Failures are injected through the optional hook ``membackend_inject_failures``.
A check that cannot run is recorded by name with the reason
(:data:`NOT_CHECKED`), and the kit's pytest plugin prints it in the terminal
summary: a missing hook is never a silent pass.

A target is a backend name (``host``), a backend over a simulated profile
(``vmm:wddm-6gb``), or an import path ``package.module:Attr`` naming a backend
class or object that need not be installed (the value an entry point would have).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pluggy

from .. import hookspec
from .._drivers.host import os_page_size, resident_bytes
from .._drivers.open import machine_for, profile_names
from .._fences import FutureToken
from .._manager import ENTRY_POINT_GROUP, BackendManager
from .._session import Session
from .._settings import load_settings
from ..hookspec import hookimpl
from ..types import Device, DriverError, DriverState, FenceToken, PluginError, Reservation
from .holdings import FDS, MAPS, Held, Holdings, TempWatch, device_number
from .measure import Truth, budget_problems, host_truth, simulated_truth, sized, tolerance_for

__all__ = ["Target", "parse_target", "resolve_targets", "build_session", "watched_session", "checker_for",
           "Checker", "KernelWatch", "driver_view", "inject_failures", "async_work", "kit_device", "NOT_CHECKED",
           "CHECKED", "UNRUN", "RERUN", "NOT_ITS_MACHINES"]

#: the backends membackend builds in (no entry point to load for them)
BUILT_IN = ("host", "vmm", "aimdo")
#: per target: the checks the kit could not run, each with the reason (printed in the summary)
NOT_CHECKED: dict[str, dict[str, str]] = {}
#: per target: what each check was made against (printed in the summary)
CHECKED: dict[str, dict[str, str]] = {}
#: per target: rules that did not run at all, counted by the reason (printed in the summary: never a silent green)
UNRUN: dict[str, dict[str, int]] = {}
#: per target whose rules did not run: what runs them (printed after the count)
RERUN: dict[str, str] = {}
#: per backend given with the profile ``all``: the simulated machines its probe refuses, each with the probe's reason
#: (the kit runs it on the others; printed in the summary as not its machines)
NOT_ITS_MACHINES: dict[str, dict[str, str]] = {}

def note(target: Any, check: str, why: str | None, against: str = "") -> None:
    """Record that ``check`` could not run on ``target`` because ``why`` (None: it ran, against ``against``)."""
    if why is None:
        CHECKED.setdefault(str(target), {})[check] = against
    else:
        NOT_CHECKED.setdefault(str(target), {})[check] = why


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """``backend`` is an installed backend's name, or ``module:attr`` when ``import_path`` is true."""

    backend: str
    profile: str | None = None
    import_path: bool = False

    def __str__(self) -> str:
        return f"{self.backend}:{self.profile}" if self.profile else self.backend


def parse_target(text: str, profiles: list[str] | None = None, gpu: bool = True) -> list[Target]:
    """``vmm:h200`` → [vmm over h200]; ``vmm:all`` → one per simulated profile whose devices support virtual
    memory management (a profile without is a machine no VMM backend serves); a bare name gets
    ``profiles`` when its backend serves GPU devices (``gpu``), else stands alone."""
    name, _, profile = text.strip().partition(":")
    chosen = [profile] if profile else (list(profiles or []) if gpu else [])
    if "all" in chosen:
        chosen = list(profile_names(vmm_only=True))
    return [Target(name, p) for p in chosen] if chosen else [Target(name)]


def resolve_targets(names: list[str], paths: list[str], profiles: list[str],
                    option: str = "--membackend-backend") -> list[Target]:
    """The kit's targets from its options (``--membackend-backend``, ``--membackend-plugin``,
    ``--membackend-profile``), checked: one :class:`~membackend.types.MembackendError` whose message says
    what is wrong and what is accepted, before any rule runs.

    Profiles apply to every target that serves GPU devices and names none (an import path's too); without
    ``--membackend-profile``, the ``sim_profile`` setting (``MEMBACKEND_SIM_PROFILE``) is the profile. The
    profile ``all`` (``--membackend-profile all``, ``NAME:all``) is every simulated machine the backend's own
    probe accepts (:func:`its_machines`); the others are recorded in :data:`NOT_ITS_MACHINES`."""
    known = profile_names()
    for p in profiles:
        if p != "all" and p not in known:
            raise PluginError(f"--membackend-profile {p!r} is not a simulated profile; accepted: "
                              f"{', '.join(known)}, all")
    settings = load_settings()
    if not profiles and settings.sim_profile:
        profiles = [settings.sim_profile]
    manager = BackendManager(settings)
    targets: list[Target] = []
    for text in names:
        name, _, profile = text.strip().partition(":")
        record = manager.records.get(name)
        if record is None:
            broken = next((why for n, why in manager.broken.items() if n.split(" ")[0] == name), None)
            raise PluginError(f"{option} {text!r}: " + (
                f"backend {name!r} is installed but broken: {broken}" if broken else
                f"no installed backend is named {name!r}; installed: {', '.join(sorted(manager.records))}"))
        if profile and profile != "all" and profile not in known:
            raise PluginError(f"{option} {text!r}: {profile!r} is not a simulated profile; "
                              f"accepted: {', '.join(known)}, all")
        gpu = any(k != "cpu" for k in getattr(record.plugin, "device_kinds", ()))
        found = parse_target(text, profiles, gpu=gpu)
        targets += its_machines(manager, name, found) if profile == "all" or (gpu and not profile
                                                                               and "all" in profiles) else found
    for path in paths:
        name = _name_of(path)
        path_manager = BackendManager(settings, entry_points=[_entry_point(path)])
        record = path_manager.records[name]
        gpu = any(k != "cpu" for k in getattr(record.plugin, "device_kinds", ()))
        chosen = (list(profile_names(vmm_only=True)) if "all" in profiles else profiles) if gpu else []
        found = [Target(path, p, import_path=True) for p in chosen] or [Target(path, import_path=True)]
        targets += its_machines(path_manager, name, found) if gpu and "all" in profiles else found
    return targets


def its_machines(manager: BackendManager, name: str, targets: list[Target]) -> list[Target]:
    """The targets of backend ``name`` (one per simulated profile, from the profile ``all``) on the machines its
    own probe accepts (a score above 0 on the profile's machine facts; a probe that accepts a machine it cannot
    serve is the rule ``test_a_platform_fits_only_machines_it_serves_truthfully``'s to catch). Each other
    profile goes into :data:`NOT_ITS_MACHINES` under the target's backend, with the probe's reason: a machine a
    platform refuses is no test of it. When it accepts none, the one target left is the backend on this machine
    (a platform of hardware no profile simulates)."""
    kept = []
    for target in targets:
        candidates, failed = manager.probe(machine_for(load_settings(sim_profile=target.profile)))
        found = candidates.get(name)
        if found is not None and found.score > 0:
            kept.append(target)
            continue
        why = f"its probe failed: {failed.get(name)}" if found is None else found.reason or "its probe scores 0"
        NOT_ITS_MACHINES.setdefault(target.backend, {})[str(target.profile)] = why
    return kept or [Target(targets[0].backend, None, targets[0].import_path)]


def _entry_point(path: str) -> importlib.metadata.EntryPoint:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise PluginError(f"--membackend-plugin {path!r} is not an import path; accepted: package.module:Attr")
    return importlib.metadata.EntryPoint(name=attr.split(".")[-1].lower(), value=path, group=ENTRY_POINT_GROUP)


_names: dict[str, str] = {}


def _name_of(path: str) -> str:
    """The name of the backend at import path ``path``, loaded exactly as an entry point would be."""
    if path not in _names:
        ep = _entry_point(path)
        quiet = logging.getLogger(BackendManager.__module__)
        level, quiet.disabled = quiet.disabled, True  # its reason is this error's message: said once
        try:
            manager = BackendManager(load_settings(), entry_points=[ep])
        finally:
            quiet.disabled = level
        origin = f"entry point {ep.name} = {ep.value}"
        found = [r.name for r in manager.records.values() if r.origin == origin]
        if not found:
            raise PluginError(f"--membackend-plugin {path!r}: the backend did not load: "
                              + "; ".join(manager.broken.values()))
        _names[path] = found[0]
    return _names[path]


def build_session(target: Target, *, sanitize: bool = False, observers: tuple = (), report: bool = True,
                  **settings: Any) -> Session:
    """A session forced onto ``target``, as a user forcing it would get, watched by the kit.

    ``settings`` are further settings keywords (``host_capacity=...``). The
    session's :class:`Checker` is :func:`checker_for` (session). ``report``:
    whether what it checks goes into the kit's summary (the doctor's
    self-test runs the same checks without one).
    """
    baseline = Holdings.take() if kernel_visible() else None  # before the backend is built: it may open files
    temp = TempWatch()
    entry_points = None
    name = target.backend
    if target.import_path:
        name = _name_of(target.backend)
        entry_points = [_entry_point(target.backend)]
    if target.profile:  # else MEMBACKEND_SIM_PROFILE or the config file's, as a user forcing the backend gets
        settings["sim_profile"] = target.profile
    s = load_settings(backend=name, sanitize=sanitize, **settings)
    if entry_points is None:  # only the target's own (what other installed backends hold is not the target's)
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        entry_points = [ep for ep in found if ep.name == name] or ([] if name in BUILT_IN else list(found))
    manager = BackendManager(s, entry_points=entry_points)
    # forced even where it serves no device (a user's forcing is refused there): the rules then skip, saying so
    return watched_session(manager, target, selection=manager.select(anywhere=True), observers=observers,
                           report=report, baseline=baseline, temp=temp)


def watched_session(manager: BackendManager, target: Target, *, machine: Any = None, selection: Any = None,
                    observers: tuple = (), report: bool = True, baseline: Holdings | None = None,
                    temp: TempWatch | None = None) -> Session:
    """A session of ``manager`` (its selected backend, or ``selection``'s) watched by the kit as
    :func:`build_session`'s are: what the kit checks it by starts now unless ``baseline`` and ``temp`` (taken
    before the backend was built) are given. The doctor's self-test uses its own manager, so no probe runs
    twice."""
    if baseline is None and kernel_visible():
        baseline, temp = Holdings.take(), TempWatch()
    record = selection.record if selection is not None else manager.records.get(manager.settings.backend or "")
    kinds = tuple(getattr(getattr(record, "plugin", None), "device_kinds", ()))
    watch = KernelWatch() if "cpu" in kinds and kernel_visible() else None
    session = manager.session(machine, observers=[*observers, *([watch] if watch else [])], selection=selection)
    checker = _checkers[session] = Checker(target, session, watch, baseline, temp, report=report)
    if watch is not None:
        watch.session, watch.keeps_for_reuse = session, checker.has["membackend_trim"]
    return session


#: the calls that bring a GPU driver up (prefixes): failing, the driver is not there (no library, no device)
DRIVER_START = ("cuInit", "hipInit", "comfy_aimdo.control.init", "import comfy_aimdo")


def kit_device(session: Session) -> Device:
    """The device the kit's rules run on: the first the backend serves on this machine.

    A backend serving none here (a GPU backend forced on a machine without its GPU), or whose driver does not
    start here (``cuInit``/``hipInit`` fails: the machine facts name a device the driver cannot reach), skips
    the rule, saying so: there is nothing the kit could run it on. Either way the summary counts it."""
    devices = session.devices()
    checker = _checkers.get(session)
    profile = checker.target.profile if checker is not None else None
    where = f"the simulated {profile}" if profile else "this machine"
    why = f"backend {session.name!r} serves no device on {where}" if not devices else None
    if devices and session.device_kinds != ("cpu",):
        try:
            session.budget_query(devices[0])
        except DriverError as exc:
            if str(exc.call).startswith(DRIVER_START):
                why = f"backend {session.name!r} cannot start its driver here ({exc})"
        else:
            if checker is not None:
                checker.driver_started()
    if why is None:
        return devices[0]
    import pytest

    target = str(checker.target) if checker is not None else session.name
    if checker is not None:
        checker.unrun = why  # nothing ran: the teardown checks nothing either
    unrun = UNRUN.setdefault(target, {})
    unrun[why] = unrun.get(why, 0) + 1
    RERUN[target] = rerun_hint(checker.target if checker is not None else Target(session.name))
    pytest.skip(f"{why}: nothing to run the rule on; {RERUN[target]}")


def rerun_hint(target: Target) -> str:
    """What runs rules that found no device on ``target``: a simulated machine where none was given; where one
    was (a platform tried on the other vendor's machine), the simulated machines its own probe fits."""
    if not target.profile:
        return "--membackend-profile=PROFILE runs them on a simulated machine"
    return f"--membackend-backend={target.backend}:all runs them on every simulated machine its probe fits"


def kernel_visible() -> bool:
    """Whether this OS shows the kit a process's mappings (/proc/self/maps) and residency (mincore)."""
    return sys.platform.startswith("linux") and os.path.exists(MAPS)


# --------------------------------------------------------------------------- the kernel's view


def mappings(lo: int, hi: int) -> list[tuple[int, int, str, str]]:
    """Every mapping of this process that overlaps ``[lo, hi)``: (start, end, perms, rest of the line)."""
    found = []
    with open(MAPS) as f:
        for line in f:
            span, perms, rest = (line.rstrip("\n").split(" ", 2) + ["", ""])[:3]
            start, _, end = span.partition("-")
            a, b = int(start, 16), int(end, 16)
            if a < hi and b > lo:
                found.append((a, b, perms, rest))
    return found


def mapped_bytes(lo: int, hi: int, maps: list[tuple[int, int, str, str]] | None = None) -> int:
    """Bytes of ``[lo, hi)`` that lie in some mapping of this process."""
    maps = mappings(lo, hi) if maps is None else maps
    return sum(min(b, hi) - max(a, lo) for a, b, _, _ in maps if a < hi and b > lo)


def resident_pages(r: Reservation, pages: range) -> list[bool] | None:
    """Per page of ``pages``: whether every OS page of it is resident (mincore); None if not all mapped."""
    if not pages:
        return []
    lo, hi = r.base + pages.start * r.page_size, r.base + pages.stop * r.page_size
    os_page = os_page_size()
    vec = (ctypes.c_ubyte * ((hi - lo) // os_page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    if libc.mincore(lo, hi - lo, vec) != 0:
        return None
    per = r.page_size // os_page
    return [all(b & 1 for b in vec[i * per:(i + 1) * per]) for i in range(len(pages))]


def _allocated(path: str, inode: tuple[int, int] | None) -> int:
    """Bytes the file at ``path`` (a path, or a ``/proc/self/fd`` entry) has allocated, when it is still the
    file ``inode`` names; 0 otherwise."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return st.st_blocks * 512 if (st.st_dev, st.st_ino) == inode else 0


def _mapped_inodes(r: Reservation) -> set[tuple[int, int]]:
    """(device, inode) of every file mapped in ``r``'s range (a file behind the reservation)."""
    found = set()
    for _, _, _, rest in mappings(r.base, r.base + r.size):
        parts = rest.split(None, 3)
        if len(parts) >= 3 and parts[2] != "0":
            found.add((device_number(parts[1]), int(parts[2])))
    return found


def _page_list(pages: list[int]) -> str:
    shown = ", ".join(map(str, pages[:8]))
    return f"[{shown}{', ...' if len(pages) > 8 else ''}]"


class KernelWatch:
    """An observer around ``fault``, ``free`` and ``release_reservation`` of a ``cpu`` backend that
    checks each call against the kernel and writes what it finds wrong into ``violations``.

    It never raises from inside a verb (that would look like the backend's own
    error); the kit asserts ``violations`` is empty after every step.
    """

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._lock = threading.Lock()  # the kit's copy threads report here too
        #: whether the backend can give back what it keeps for reuse before close (``membackend_trim``): then
        #: what a released reservation opened may stay until trim or close, where the kit checks it
        self.keeps_for_reuse = False
        self.session: Session | None = None  # set once the session exists (to tell shared files apart)
        #: per live reservation: the descriptors, shared mappings and files its reserve and faults opened
        self.owned: dict[int, dict[tuple, Held]] = {}
        #: every file on disk a descriptor or mapping of the backend named during the session
        self.files_seen: dict[str, Held] = {}

    def _opened(self, r: Reservation | None, before: Holdings | None) -> None:
        """Attribute to ``r`` what the process holds now that it did not hold ``before``."""
        if before is None or r is None:
            return
        now = Holdings.take()
        new = now.since(before)
        self.owned.setdefault(r.id, {}).update({h.key: h for h in new})
        for path, h in now.files().items():
            if h in new:
                self.owned[r.id][("file", path)] = Held("file", ("file", path), f"file {path}", h.inode)
                self.files_seen.setdefault(path, h)

    @hookimpl(wrapper=True)
    def membackend_reserve(self, device: Device, size: int):
        before = Holdings.take()
        r = yield
        self._opened(r, before)
        return r

    @hookimpl(wrapper=True)
    def membackend_fault(self, reservation: Reservation, offset: int, size: int):
        r = reservation
        pages = r.page_range(offset, size)
        before = resident_pages(r, pages)
        held = Holdings.take()
        try:
            f = yield
        finally:
            self._opened(r, held)
        after = resident_pages(r, pages)
        where = f"fault(#{r.id}, offset={offset}, size={size}) on [{r.base:#x}, {r.base + r.size:#x})"
        if after is None:
            self.report(f"{where}: the range is no longer mapped in {MAPS}")
        elif f.ok:
            missing = [p for p, ok in zip(pages, after) if not ok]
            if missing:
                self.report(f"{where} returned ok but page(s) {_page_list(missing)} are not resident "
                                       f"(mincore; expected all of pages {pages.start}..{pages.stop - 1})")
            elif before is not None:
                new = [p for p, was in zip(pages, before) if not was]
                self._check_writes(where, r, new)
        elif before is not None:
            left = [p for p, was, now in zip(pages, before, after) if now and not was]
            if left:
                self.report(f"{where} returned out of memory (ok=False) but left page(s) "
                                       f"{_page_list(left)} resident (mincore): a failed fault must roll back")
        return f

    def _check_writes(self, where: str, r: Reservation, pages: list[int]) -> None:
        """Write and read back a byte at both ends of each newly backed page.

        Only pages the kernel reports resident and mapped read-write are
        touched, so a wrong backend is reported, never a crash; newly backed
        pages carry no recorded asynchronous work that could race the check.
        """
        if not pages:
            return
        maps = mappings(r.base + pages[0] * r.page_size, r.base + (pages[-1] + 1) * r.page_size)
        for p in pages:
            for addr in (r.base + p * r.page_size, r.base + (p + 1) * r.page_size - 1):
                perms = next((pm for a, b, pm, _ in maps if a <= addr < b), "")
                if not perms.startswith("rw"):
                    self.report(f"{where}: page {p} is resident but not writable ({MAPS} perms "
                                           f"{perms or 'none'} at {addr:#x}; expected rw)")
                    return
                cell = ctypes.c_ubyte.from_address(addr)
                old = cell.value
                cell.value = old ^ 0xFF
                back = cell.value
                cell.value = old
                if back != old ^ 0xFF:
                    self.report(f"{where}: wrote {old ^ 0xFF:#04x} at {addr:#x} (page {p}), read {back:#04x}")
                    return

    @hookimpl(wrapper=True)
    def membackend_free(self, reservation: Reservation, offset: int, size: int):
        r = reservation
        dropped = yield
        ps = r.page_size
        lo, hi = r.base + offset, r.base + -(-(offset + size) // ps) * ps
        try:
            still = resident_bytes(lo, hi - lo)
        except DriverError as exc:
            self.report(f"free(#{r.id}, offset={offset}, size={size}): the range is not mapped: {exc}")
            return dropped
        if still:
            self.report(f"free(#{r.id}, offset={offset}, size={size}) returned {dropped} but {still} bytes "
                                   f"of [{lo:#x}, {hi:#x}) are still resident (mincore; expected 0)")
        return dropped

    @hookimpl(wrapper=True)
    def membackend_release_reservation(self, reservation: Reservation):
        r = reservation
        before = set(mappings(r.base, r.base + r.size))
        dropped = yield
        # a fresh mapping may reuse the hole at once (the kernel hands out the highest gap that
        # fits); only a line identical to one from before proves the range was never unmapped
        kept = sorted(set(mappings(r.base, r.base + r.size)) & before)
        where = f"release_reservation(#{r.id}) of [{r.base:#x}, {r.base + r.size:#x}) returned {dropped}"
        if kept:
            lines = "; ".join(f"{a:#x}-{b:#x} {pm} {rest}".rstrip() for a, b, pm, rest in kept)
            self.report(f"{where} but the range is still mapped ({MAPS}: {lines}; expected gone)")
        left = self._left_by(r)
        if left:
            self.report(f"{where} but left what its reserve and faults opened, holding memory: {'; '.join(left)} "
                        "(expected given back: the backend has no membackend_trim to give it back later)")
        return dropped

    def _left_by(self, r: Reservation) -> list[str]:
        """What ``r``'s reserve and faults opened that is still there holding memory, less what a live
        reservation shares (one file behind several reservations, a pool: it goes when the last of them
        goes). A backend with ``membackend_trim`` may keep it for reuse: then it is checked after close."""
        owned = self.owned.pop(r.id, {})
        if not owned or self.keeps_for_reuse:
            return []
        now = Holdings.take()
        alive = self.session.reservations() if self.session is not None else ()
        shared: set[tuple[int, int] | None] = {inode for other in alive if other.id != r.id
                                               for inode in _mapped_inodes(other)}
        shared |= {h.inode for rid, held in self.owned.items() for h in held.values()}
        left = []
        for h in owned.values():
            if h.inode in shared:
                continue
            if h.kind == "mapping" and now.holds(h):
                left.append(h.text)  # a second view of the memory, outside the released range
            elif h.kind == "file" and _allocated(h.key[1], h.inode):
                left.append(f"{h.text} (still on disk, {_allocated(h.key[1], h.inode)} bytes allocated)")
            elif h.kind == "descriptor" and now.holds(h) and _allocated(f"{FDS}/{h.key[1]}", h.inode):
                left.append(f"{h.text} ({_allocated(f'{FDS}/{h.key[1]}', h.inode)} bytes allocated)")
        return left

    def report(self, violation: str) -> None:
        """Add a finding (from any thread)."""
        with self._lock:
            self.violations.append(violation)

    def take(self) -> list[str]:
        with self._lock:
            found, self.violations = self.violations, []
        return found


# --------------------------------------------------------------------------- the checker


def _hooks(backend: Any) -> pluggy.PluginManager:
    """A plugin manager holding only ``backend``, for calling its optional hooks as pluggy would."""
    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    pm.register(backend, name="backend")
    return pm


class Checker:
    """Everything the kit checks one session against, besides the session's own ledger."""

    def __init__(self, target: Target, session: Session, watch: KernelWatch | None,
                 baseline: Holdings | None = None, temp: TempWatch | None = None, report: bool = True):
        self.target, self.session, self.watch = target, session, watch
        self.baseline, self.temp = baseline, temp
        self.unrun: str | None = None  # why the rules did not run (kit_device), if they did not
        self._rebased = False
        self.report = report
        if baseline is not None:
            self.note("leaks after close", None, f"{FDS}, {MAPS} and the files they named")
        self.pm = _hooks(session.backend)
        self.has = {h: bool(getattr(self.pm.hook, h).get_hookimpls()) for h in hookspec.OPTIONAL_HOOKS}
        cpu = "cpu" in session.device_kinds
        if watch is not None:
            self.note("ledger vs kernel", None, f"{MAPS} and mincore after every verb")
        elif cpu:
            self.note("ledger vs kernel", f"{MAPS} and mincore are not available on {sys.platform}")
        if self.has["membackend_inspect"]:
            self.note("ledger vs driver", None, "membackend_inspect")
        elif not cpu:
            self.note("ledger vs driver", "no membackend_inspect")
            self.note("leaks in the driver", "no membackend_inspect")
        if not self.has["membackend_inject_failures"]:
            self.note("rollback under injected driver failures", "no membackend_inject_failures")
        self.inspect_says_none = False

    def driver_started(self) -> None:
        """A GPU driver came up: what it holds for the process's life (its runtime's descriptors, mappings)
        is the driver's, so what the kit checks the close by starts from here (once)."""
        if self.baseline is not None and not self._rebased:
            self._rebased = True
            self.baseline = Holdings.take()

    def note(self, check: str, why: str | None, against: str = "") -> None:
        """:func:`note` for this checker's target, when it reports to the kit's summary."""
        if self.report:
            note(self.target, check, why, against)

    # ------------------------------------------------------------------ views

    def inspect(self, device: Device) -> DriverState | None:
        if not self.has["membackend_inspect"]:
            return None
        state = self.pm.hook.membackend_inspect(device=device)
        if state is None:
            if not self.inspect_says_none:
                self.inspect_says_none = True
                self.note("ledger vs driver", "membackend_inspect returned None (the driver cannot be asked)")
            return None
        assert isinstance(state, DriverState), \
            f"membackend_inspect({device}) returned {state!r}; expected a membackend.types.DriverState or None"
        return state

    def truth(self, device: Device) -> Truth | None:
        """An independent measure of ``device``'s memory (:mod:`membackend.testing.measure`), or None."""
        if device.kind == "cpu":
            return host_truth() if kernel_visible() else None
        return simulated_truth(self.session, device)

    def budget_problems(self, device: Device) -> tuple[Any, list[str], str | None]:
        """``(budget, what is wrong with it, the independent source)``: the budget read between two readings of
        the machine (the higher free counts: a host's memory moves with every process), against
        :meth:`truth`; the source is None when there is nothing independent to compare with."""
        truth = self.truth(device)
        budget = self.session.budget_query(device)
        after = self.truth(device)
        if truth is None:
            return budget, [], None
        high = truth if after is None or after.free_high < truth.free_high else after
        bracket = Truth(truth.total, min(truth.free_low, high.free_low), high.free_high, truth.source)
        return budget, budget_problems(bracket, budget, self.held(device), tolerance_for(truth, device)), \
            truth.source

    def held(self, device: Device) -> int:
        """Bytes the driver says the backend keeps for reuse on ``device`` (``DriverState.held``; 0 unknown)."""
        state = self.inspect(device)
        return state.held if state is not None else 0

    def resident(self, device: Device) -> int | None:
        """Resident bytes on ``device`` as the driver counts them (``membackend_inspect``), or None."""
        state = self.inspect(device)
        return state.resident if state is not None else None

    def kernel_state(self, device: Device) -> DriverState | None:
        """Reserved and resident bytes of this session's live reservations, as the kernel counts them."""
        if self.watch is None or device.kind != "cpu":
            return None
        alive = [r for r in self.session.reservations() if r.device == device]
        reserved = sum(mapped_bytes(r.base, r.base + r.size) for r in alive)
        resident = sum(resident_bytes(r.base, r.size) if mapped_bytes(r.base, r.base + r.size) == r.size else 0
                       for r in alive)
        return DriverState(reserved, resident, source=f"kernel ({MAPS}, mincore)")

    # ------------------------------------------------------------------ checks

    def verify(self, device: Device, step: str = "") -> None:
        """Assert that the ledger equals the kernel's and the driver's views; messages carry the values."""
        s = self.session
        acct = s.ledger.account(device)
        alive = [r for r in s.reservations() if r.device == device]
        problems = self.watch.take() if self.watch is not None else []
        if self.watch is not None and device.kind == "cpu":
            for r in alive:
                mapped = mapped_bytes(r.base, r.base + r.size)
                if mapped != r.size:
                    problems.append(f"reservation #{r.id} [{r.base:#x}, {r.base + r.size:#x}) of {sized(r.size)}: "
                                    f"{sized(mapped)} mapped in {MAPS} (expected all)")
                    continue
                found, expected = resident_bytes(r.base, r.size), s.ledger.resident(r)
                if found != expected:
                    problems.append(f"reservation #{r.id}: ledger says {sized(expected)} resident, the kernel "
                                    f"(mincore) finds {sized(found)}")
        state = self.inspect(device)
        if state is not None and (state.reserved, state.resident) != (acct.reserved, acct.resident):
            problems.append(f"{device}: ledger reserved={sized(acct.reserved)} resident={sized(acct.resident)}, "
                            f"driver ({state.source or 'membackend_inspect'}) reserved={sized(state.reserved)} "
                            f"resident={sized(state.resident)}")
        if state is not None and state.hazards:
            problems.append(f"{device}: the driver saw {state.hazards} unsafe operation(s) on memory that "
                            f"asynchronous work still used ({state.source or 'membackend_inspect'}; expected 0)")
        mine = sum(s.ledger.resident(r) for r in alive)
        if (acct.resident, acct.reservations_alive) != (mine, len(alive)):
            problems.append(f"{device}: ledger account resident={sized(acct.resident)} alive={acct.reservations_alive}"
                            f", but its reservations sum to resident={sized(mine)} alive={len(alive)}")
        assert not problems, f"{self.target}{' after ' + step if step else ''}: " + "; ".join(problems)

    def verify_nothing_left(self, device: Device, step: str = "after close()") -> None:
        """After ``close()``: nothing in the ledger, the kernel or the driver; trimmed memory given back."""
        s = self.session
        acct = s.ledger.account(device)
        problems = self.watch.take() if self.watch is not None else []
        left = (acct.reserved, acct.resident, acct.reservations_alive, acct.pending_fences)
        if left != (0, 0, 0, 0):
            problems.append(f"ledger still holds reserved={sized(left[0])} resident={sized(left[1])} alive={left[2]} "
                            f"pending fences={left[3]} (expected all 0)")
        if self.has["membackend_trim"]:
            held = self.inspect(device)
            given = self.pm.hook.membackend_trim(device=device)
            after = self.inspect(device)
            if held is not None and after is not None and given != held.held - after.held:
                problems.append(f"membackend_trim({device}) returned {given!r}; the driver's held bytes went from "
                                f"{sized(held.held)} to {sized(after.held)}: expected {sized(held.held - after.held)}")
        state = self.inspect(device)
        if state is not None and (state.reserved, state.resident, state.held) != (0, 0, 0):
            trimmed = " after membackend_trim" if self.has["membackend_trim"] else " (no membackend_trim)"
            problems.append(f"leaked in the driver{trimmed}: reserved={sized(state.reserved)} "
                            f"resident={sized(state.resident)} held={sized(state.held)} ({state.source}; expected "
                            "all 0)")
        problems += self.left_behind()
        assert not problems, f"{self.target} {step}: " + "; ".join(problems)

    def left_behind(self) -> list[str]:
        """What the process holds now that it did not before the session's backend was built: descriptors,
        shared mappings of files (``(deleted)`` ones included), and files on disk the backend's descriptors
        and mappings named during the session (with the folder it made for them in the temporary directory)."""
        if self.baseline is None:
            return []
        now = Holdings.take()
        new = now.since(self.baseline)
        found = [h.text for h in new]
        seen = dict(self.watch.files_seen) if self.watch is not None else {}
        seen.update({p: h for p, h in now.files().items() if h in new})
        folders = set()
        for path in sorted(seen):
            if os.path.exists(path) and path not in self.baseline.files():
                found.append(f"file {path} (still on disk)")
            folder = self.temp.made_since(path) if self.temp is not None else None
            if folder is not None and folder != path and os.path.exists(folder):
                folders.add(folder)
        found += [f"folder {f} (made during the session, still on disk)" for f in sorted(folders)]
        return [f"left behind: {'; '.join(found)} (expected nothing the backend opened or made)"] if found else []

    # ------------------------------------------------------------------ failure injection

    def start_injection(self, probability: float, seed: int) -> Any:
        """The backend's ``FailureInjection``, or None where it cannot inject (noted by name)."""
        if not self.has["membackend_inject_failures"]:
            return None
        injection = self.pm.hook.membackend_inject_failures(probability=probability, seed=seed)
        if injection is None:
            self.note("rollback under injected driver failures", "membackend_inject_failures returned None")
            return None
        self.note("rollback under injected driver failures", None, "membackend_inject_failures")
        assert callable(getattr(injection, "stop", None)) and isinstance(getattr(injection, "injected", None), int), \
            f"membackend_inject_failures returned {injection!r}; expected an object with injected (int) and stop()"
        return injection


_checkers: "weakref.WeakKeyDictionary[Session, Checker]" = weakref.WeakKeyDictionary()


def checker_for(session: Session) -> Checker:
    """The kit's :class:`Checker` of a session made by :func:`build_session`."""
    try:
        return _checkers[session]
    except KeyError:
        raise PluginError("this session was not made by membackend.testing.build_session") from None


def driver_view(session: Session, device: Device) -> DriverState | None:
    """What the platform holds on ``device``: the kernel's view for ``cpu``, else ``membackend_inspect``'s."""
    checker = checker_for(session)
    return checker.kernel_state(device) or checker.inspect(device)


@contextmanager
def inject_failures(session: Session, probability: float, seed: int = 0) -> Iterator[Any]:
    """Fail the backend's driver calls at random while inside (``membackend_inject_failures``).

    Yields the ``FailureInjection`` (its ``injected`` counts the failures), or
    None when the backend cannot inject; stops it on the way out.
    """
    injection = checker_for(session).start_injection(probability, seed)
    try:
        yield injection
    finally:
        if injection is not None:
            injection.stop()


# --------------------------------------------------------------------------- asynchronous work

_copies = ThreadPoolExecutor(2, thread_name_prefix="membackend-kit-copy")


class _Holding:
    """A fence token that keeps the copy's host source alive until the copy is known to be finished."""

    def __init__(self, token: FenceToken, source: Any):
        self._token, self._source = token, source

    def done(self) -> bool:
        finished = self._token.done()
        if finished:
            self._source = None
        return finished

    def wait(self) -> None:
        self._token.wait()
        self._source = None


class _TimerToken:
    """Work the kit cannot start on the device: a timer that touches nothing."""

    def __init__(self, seconds: float):
        self._event = threading.Event()
        threading.Timer(seconds, self._event.set).start()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()


def async_work(session: Session, r: Reservation, offset: int, size: int, seconds: float = 0.002) -> FenceToken:
    """Start asynchronous work on a resident range and return its fence token.

    ``cpu`` reservations: a thread writes the range after a delay (freeing it
    under the copy would crash the process or show up as resident again).
    Backends with a public ``fence_token(reservation, stream)`` and a
    ``driver`` that copies asynchronously (the VMM backend): a real copy on a
    stream, fenced by an event. Elsewhere a timer that touches nothing, and the
    summary says so.
    """
    backend = session.backend
    if r.device.kind == "cpu":
        watch = checker_for(session).watch

        def copy() -> None:
            time.sleep(seconds)
            lo, hi = r.base + offset, r.base + offset + size
            spans = [(a, b) for a, b, perms, _ in mappings(lo, hi) if perms.startswith("rw")]
            if sum(min(b, hi) - max(a, lo) for a, b in spans) != size:  # a write would kill the process
                if watch is not None:
                    watch.report(f"copy into [{lo:#x}, {hi:#x}) of #{r.id}: the range is not mapped read-write "
                                 f"({MAPS}); a resident page must be writable")
                return
            ctypes.memset(lo, 0x5A, size)
        return FutureToken(_copies.submit(copy))
    driver, fence_token = getattr(backend, "driver", None), session.members.fence_token  # driver: not a row
    if driver is not None and fence_token is not None and hasattr(driver, "memcpy_htod_async"):
        driver.set_device(r.device.index)
        stream = driver.stream_create()
        source = ctypes.create_string_buffer(size)  # a real driver reads it when the copy runs: kept with the token
        driver.memcpy_htod_async(r.base + offset, ctypes.addressof(source), size, stream)
        return _Holding(fence_token(r, stream), source)
    checker_for(session).note("fences against device work",
         "the kit cannot start work on this backend's devices (timer tokens only)")
    return _TimerToken(seconds)
