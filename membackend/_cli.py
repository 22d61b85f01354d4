"""``membackend doctor | backends | budget`` — what membackend sees and whether it works.

``membackend comfyui install|uninstall <ComfyUI folder>`` adds or removes the
custom node that starts membackend inside ComfyUI (see ``docs/comfyui.md``).

``membackend replay SCENARIO|TRACE_FILE`` runs a seed report's workload (or a recorded
trace) stock and plugin side by side (``membackend.lab._replay``; ``--plot`` draws the timelines
with ``membackend.lab._pictures``); ``membackend bench`` runs the benchmark suite
(``membackend.lab.bench``).

Exit codes: 0 ok; 1 the self-test failed, or a replay's plugin side broke a
guarantee; 2 a configuration error (its message is printed, one line), including a
forced backend that is not installed (with the closest installed name and where the
name was set), broken, blocked or serving no device of this machine (with its probe's
reason), a bad value of a setting a platform plugin declares, a simulated profile
that does not exist (with the closest name), a ``host_capacity`` above the RAM, one
variable set in two spellings with different values, a path that cannot be looked
up (a part too long, a folder this user may not search), a folder that is not a
ComfyUI checkout, and a trace that cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

import psutil

from ._version import __version__
from ._drivers.open import machine_for
from ._manager import BackendManager, Selection
from ._session import Session
from ._settings import load_settings
from ._settings.rules import FIELDS as SETTING_FIELDS
from ._settings.rules import format_bytes, os_reason, quoted, shown
from ._settings.sources import ENV_PREFIX
from .types import BackendDisabled, Budget, Machine, MembackendError, format_size

log = logging.getLogger(__name__)

MiB = 1 << 20
SELFTEST_RESERVE = 256 * MiB
SELFTEST_FAULT = 128 * MiB


def _size(n: int | None) -> str:
    """A size as membackend writes one everywhere (``types.format_size``: ``6.0 GiB``); ``-`` for none."""
    return "-" if n is None else format_size(n)


def _rss() -> int:
    return psutil.Process().memory_info().rss


# --------------------------------------------------------------------------- gathering


def machine_report(m: Machine) -> dict[str, Any]:
    """The machine facts as JSON: every field, ``sources`` per field (machine and device), and the
    ``discovery`` lines (what each driver binding answered)."""
    d = dataclasses.asdict(m)
    d["sources"], d["discovery"] = dict(m.sources), list(m.discovery)
    d["devices"] = [{**dataclasses.asdict(i), "device": str(i.device), "sources": dict(i.sources)}
                    for i in m.devices]
    return d


def backends_report(mgr: BackendManager, sel: Selection) -> list[dict[str, Any]]:
    rows = []
    for name, rec in sorted(mgr.records.items()):
        c = sel.candidates.get(name)
        rows.append({
            "name": name, "version": rec.version, "origin": rec.origin,
            "score": c.score if c else None, "opt_in": bool(c and c.opt_in),
            "reason": c.reason if c else sel.broken.get(name, "not probed (membackend is disabled)"),
            "blocked": name in sel.blocked, "selected": sel.record is rec,
        })
    for name, why in sorted(sel.broken.items()):
        if name not in mgr.records:
            rows.append({"name": name, "version": None, "origin": None, "score": None, "reason": why,
                         "blocked": False, "selected": False, "broken": True})
        elif name not in sel.candidates:
            next(r for r in rows if r["name"] == name)["broken"] = True
    return rows


def budgets_report(session: Session) -> list[dict[str, Any]]:
    """Each device's budget, with where its headroom comes from (``Session.headroom_in_force``) and, where each
    handle holds a file descriptor (``VmmBackend.descriptor_room``), what the start did to the descriptor limit
    and what the device can map under it when that is below the budget (total less headroom)."""
    rows = []
    room = session.members.descriptor_room  # read once with the session (hookspec.OptionalMembers)
    for dev in session.devices():
        try:
            b = session.budget_query(dev)
            rows.append({"device": str(dev), **dataclasses.asdict(b),
                         "headroom_source": session.headroom_in_force(dev)[1]})
            d = room(dev) if room is not None else None
            if d is not None:
                rows[-1]["descriptors"] = {**dataclasses.asdict(d), "free": d.free, "mappable": d.mappable,
                                           "line": d.describe(max(0, b.total - b.headroom))}
        except MembackendError as exc:
            rows.append({"device": str(dev), "error": str(exc)})
    return rows


def cache_report(mgr: BackendManager) -> dict[str, Any]:
    """What the ``keep_dropped`` setting lets ComfyUI's adapter keep of dropped models' weights (issue 41): the
    bytes themselves exist only while ComfyUI runs (its status route and memory panel show them per device, as
    "cached, reclaimable", apart from what live models hold)."""
    keep = getattr(mgr.settings, "keep_dropped", "auto")
    if keep == "off":
        words = "off: a model ComfyUI drops gives its memory back at once, and its file is read again next time"
    else:
        bound = "as the room allows" if keep == "auto" else f"at most {_size(int(keep))} per device"
        words = (f"{keep if keep == 'auto' else _size(int(keep))}: the weights of models ComfyUI drops stay in VRAM {bound}, reclaimable (they go first "
                 "when memory is wanted; POST /free empties them), and a load of the same file copies from them; "
                 "while ComfyUI runs its status and memory panel show them apart from live models")
    return {"keep_dropped": keep, "source": mgr.settings.source_of("keep_dropped"), "line": words}


def settings_report(mgr: BackendManager) -> dict[str, Any]:
    """Every setting's value and source: membackend's own (``machine.*`` only where set), then the settings
    each loaded platform declares; the ``MEMBACKEND_*`` variables that no setting reads; the settings tables
    that name no installed platform."""
    s = mgr.settings
    source_of = getattr(s, "source_of", lambda key: "?")
    rows: list[dict[str, Any]] = []
    for f in SETTING_FIELDS:
        if f.table is not None:
            for fact in f.table:
                if source_of(f"{f.name}.{fact.name}") != "default":
                    rows.append({"key": f"{f.name}.{fact.name}", "value": getattr(s.machine, fact.name),
                                 "source": source_of(f"{f.name}.{fact.name}"), "kind": fact.rule.kind,
                                 "env": f"{ENV_PREFIX}{f.name.upper()}__{fact.name.upper()}"})
            continue
        rows.append({"key": f.name, "value": getattr(s, f.name), "source": source_of(f.name), "kind": f.rule.kind,
                     "env": ENV_PREFIX + f.name.upper()})
    read: list[str] = []
    for name, rec in sorted(mgr.records.items()):
        values = rec.values
        if values is None:
            continue
        for key in values:
            read.append(values.env_name(key))
            rows.append({"key": f"{name}.{key}", "value": values[key], "source": values.source(key),
                         "kind": values.kind(key), "env": values.env_name(key)})
    snapshot = getattr(s, "snapshot", None)
    sources = snapshot() if callable(snapshot) else None
    unread: list[dict[str, str]] = []
    tables: list[str] = []
    if sources is not None:
        broken = {name.split(" ")[0] for name in mgr.broken}
        for var in sources.unread_env(read):
            owner = next((n for n in (*mgr.records, *broken) if var.upper().startswith(
                f"{ENV_PREFIX}{n.upper().replace('-', '_')}_")), None)
            if owner in broken:
                continue  # the plugin is listed as broken, with the reason
            declared = [k for k in getattr(mgr.records.get(owner) if owner else None, "values", None) or ()]
            why = (f"platform {owner} declares no such setting (it declares: {', '.join(declared) or 'none'})"
                   if owner else "no setting of membackend or of an installed platform has this name")
            unread.append({"env": var, "why": why})
        tables = sorted(sources.platform_tables() - set(mgr.records) - broken)
    return {"values": rows, "unread": unread, "tables_without_platform": tables}


def _shown(value: Any, kind: str) -> str:
    if value is None or value == []:
        return "-"
    if kind.endswith("size") and isinstance(value, int) and not isinstance(value, bool):  # size, page size
        return format_bytes(value)
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _print_settings(report: dict[str, Any]) -> None:
    print("settings:")
    for row in report["values"]:
        print(f"  {row['key']}: {_shown(row['value'], row['kind'])}  [{row['source']}]")
    for row in report["unread"]:
        print(f"  {row['env']} is set but not read: {row['why']}")
    for name in report["tables_without_platform"]:
        print(f"  the settings table [{name}] names no installed platform")


def self_test(mgr: BackendManager, machine: Machine, sel: Selection) -> dict[str, Any]:
    """A short run of the conformance kit's own checks on the selected backend (``sel``, of ``mgr``: no probe
    runs twice), in a session of its own that it closes: the budget against an independent measure of the
    machine, then reserve, fault, free and release, each followed by the kit's check of the ledger against the
    kernel (``cpu``) or the driver, then close and the kit's check that nothing was left behind. A failed
    step's detail is the kit's own message (:mod:`membackend.testing.harness`); RSS is shown, never judged."""
    from .testing.harness import Target, checker_for, watched_session

    backend = sel.record.name if sel.record is not None else "none"

    def error(detail: str) -> dict[str, Any]:
        return {"ok": False, "backend": backend, "device": None, "steps": [{
            "step": "error", "ok": False, "rss": _rss(), "ledger_resident": 0, "ledger_reserved": 0,
            "detail": detail}]}

    try:
        session = watched_session(mgr, Target(backend), machine=machine, selection=sel, report=False)
    except MembackendError as exc:
        return error(f"{type(exc).__name__}: {exc}")
    checker = checker_for(session)
    devices = session.devices()
    if not devices:
        session.close()
        return error(f"no {'/'.join(session.device_kinds)} device that {session.name!r} serves was found here")
    dev = devices[0]
    steps: list[dict[str, Any]] = []
    ok = True

    def step(name: str, detail: str, check: Any = None, passed: bool = True) -> None:
        """Record a step; ``check()`` is the kit's check after it (its AssertionError fails the step)."""
        nonlocal ok
        if check is not None:
            try:
                check()
            except AssertionError as exc:
                passed, detail = False, str(exc).split("\nassert ")[0]
        ok = ok and passed
        acct = session.ledger.account(dev)
        steps.append({"step": name, "ok": passed, "detail": detail, "rss": _rss(),
                      "ledger_resident": acct.resident, "ledger_reserved": acct.reserved})

    before = session.ledger.account(dev)
    steps.append({"step": "baseline", "ok": True, "detail": "", "rss": _rss(), "ledger_resident": before.resident,
                  "ledger_reserved": before.reserved})
    r = None
    closed = False
    try:
        budget, problems, source = _budget_or_say(checker, dev)
        step("budget", "; ".join(problems) if problems else
             f"usable {_size(budget.usable)} of {_size(budget.total)}" + (f", as {source} says" if source else ""),
             passed=not problems)
        fault_size = max(min(SELFTEST_FAULT, budget.usable // 4), 1)
        r = session.reserve(dev, SELFTEST_RESERVE)
        step("reserve", f"{_size(r.size)} of address space at {r.base:#x}", lambda: checker.verify(dev, "reserve"))
        f = session.fault(r, 0, fault_size)
        step("fault", f"{_size(fault_size)} backed, ok={f.ok}", lambda: _check_fault(f, checker, dev))
        dropped = session.free(r)
        step("free", f"{_size(dropped)} dropped", lambda: checker.verify(dev, "free"))
        session.release_reservation(r)
        step("release", "address range returned", lambda: checker.verify(dev, "release_reservation"))
        closed = True
        session.close()
        step("close", "nothing left behind", lambda: checker.verify_nothing_left(dev, "after close()"))
    except _Said as said:
        step("error", str(said), passed=False)
    except MembackendError as exc:
        step("error", f"{type(exc).__name__}: {exc}", passed=False)
    finally:
        if not closed:
            try:
                session.close()
            except MembackendError as exc:
                step("close", f"{type(exc).__name__}: {exc}", passed=False)
    listed = next((d for d in machine.devices if d.device == dev), None)
    note = (f"RSS is this process's own resident memory: the bytes of a GPU simulated by {listed.source} are pages "
            "of a memfd, counted there only once written, and a fault maps them without writing (a real GPU's never "
            "count there); the ledger column is the device's figure") if listed is not None and listed.simulated else ""
    return {"ok": ok, "backend": backend, "device": str(dev), "steps": steps, "rss_note": note}


class _Said(Exception):
    """A self-test step that failed, with the words to print."""


def _budget_or_say(checker: Any, dev: Any) -> tuple[Budget, list[str], str | None]:
    """The kit's own budget check (``Checker.budget_problems``); a failed query is said, not raised."""
    try:
        return checker.budget_problems(dev)
    except MembackendError as exc:
        raise _Said(f"budget query failed: {type(exc).__name__}: {exc}") from exc


def _holds(condition: bool, message: str) -> None:
    """A self-test check of its own, failing as the kit's do (AssertionError with the message)."""
    if not condition:
        raise AssertionError(message)


def _check_fault(f: Any, checker: Any, dev: Any) -> None:
    _holds(f.ok, f"fault returned {f!r}: out of memory within the budget's usable memory")
    checker.verify(dev, "fault")


def kept_windows_report(session: Session) -> list[dict[str, Any]]:
    """Per device, the address windows a backend under a reserve-churn limit keeps reserved after release,
    the large frees it spent and the bound on what stays (``VmmBackend.kept_windows``); empty elsewhere."""
    kept = session.members.kept_windows
    rows: list[dict[str, Any]] = []
    if kept is None:
        return rows
    for dev in session.devices():
        try:
            k = kept(dev)
        except MembackendError as exc:
            rows.append({"device": str(dev), "line": f"{dev}: {type(exc).__name__}: {exc}"})
            continue
        if k is not None:
            rows.append({**dataclasses.asdict(k), "device": str(dev), "line": k.describe()})
    return rows


# --------------------------------------------------------------------------- printing


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


#: the device facts the doctor prints, with how each value is shown
_DEVICE_FACTS = (("name", "name", lambda v: v or "?"), ("total_memory", "total memory", _size),
                 ("arch", "arch", lambda v: v or "?"), ("integrated", "integrated", _yes),
                 ("unified", "one pool with the host", _yes), ("vmm_supported", "virtual memory management", _yes),
                 ("driver_model", "driver model", lambda v: v or "-"), ("luid", "LUID", lambda v: v or "-"))


def _print_machine(m: Machine) -> None:
    """Every fact with its source in brackets (``[?]``: nothing answered for it), then what each
    driver binding answered (the discovery lines)."""
    def src(name: str) -> str:
        return m.source_of(name) or "?"

    print("machine:")
    print(f"  OS: {m.os}  [{src('os')}]")
    print(f"  CPUs: {m.cpus}  [{src('cpus')}]")
    print(f"  RAM: {_size(m.ram_total)} ({_size(m.ram_available)} available)  [{src('ram_total')}]")
    print(f"  cgroup limit: {_size(m.cgroup_limit) if m.cgroup_limit else 'none'}  [{src('cgroup_limit')}]")
    print(f"  torch: {m.torch_version or 'not installed'} ({m.torch_vendor or '-'} build)  [{src('torch_version')}]")
    if not m.devices:
        print("  GPUs: none found")
    for d in m.devices:
        print(f"  {d.device}: {d.name or '?'}  (listed by {d.source or '?'})")
        for name, label, show in _DEVICE_FACTS:
            value, where = getattr(d, name), d.source_of(name)
            if where is None and name in ("driver_model", "luid") and value is None:
                continue  # not asked off Windows
            print(f"    {label}: {show(value)}  [{where or '?'}]")
    if m.discovery:
        print("  discovery:")
        for line in m.discovery:
            print(f"    {line}")
    if m.overridden:
        print(f"  overridden by settings: {', '.join(m.overridden)}")
    for line in hidden_gpus(m, os.environ):
        print(f"  {line}")


#: the variables that hide GPUs from a process: CUDA's, and HIP's (which honours CUDA's too) and ROCr's
VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def hidden_gpus(machine: Machine, environ: Any) -> list[str]:
    """What hides a GPU from ComfyUI, in words for the doctor: a visibility variable set in this environment
    (the devices listed above are already what it lets through), and on Windows with two or more GPUs,
    ComfyUI 0.38's own start-up, which sets ``CUDA_VISIBLE_DEVICES=0`` unless started with
    ``--cuda-device all`` (HIP honours the variable too): the second GPU is then hidden from ComfyUI, and so
    from membackend inside it."""
    gpus = machine.gpus()
    simulated = any(d.simulated for d in gpus)
    seen = "the simulated driver ignores it" if simulated else "the list above is what it lets through"
    out = [f"{name}={quoted(environ[name])} is set: only the GPUs it names are visible to this process ({seen})"
           for name in VISIBILITY_VARIABLES if environ.get(name) is not None]
    if machine.os == "windows" and len(gpus) >= 2:
        out.append(f"{len(gpus)} GPUs: ComfyUI 0.38 and later set CUDA_VISIBLE_DEVICES=0 on Windows unless started "
                   f"with --cuda-device all, which hides {', '.join(str(d.device) for d in gpus[1:])} from ComfyUI "
                   "(and from membackend inside it)")
    return out


def _print_backends(rows: list[dict[str, Any]], sel: Selection) -> None:
    print("backends:")
    for r in rows:
        mark = "*" if r["selected"] else " "
        state = "BROKEN" if r.get("broken") else ("blocked" if r["blocked"] else f"score {r['score']}")
        reason = r["reason"] + ("; opt-in: used only when forced by name" if r.get("opt_in") else "")
        print(f" {mark} {r['name']:<16} {r['version'] or '':<10} {state:<10} {reason}")
        if r["origin"]:
            print(f"   {'':16} from {r['origin']}")
    if sel.tied:
        print(f"  tie at the top: {', '.join(sel.tied)} (the first by name was chosen; "
              f"force one with MEMBACKEND_BACKEND)")
    if sel.record is None:
        print(f"selected: none ({sel.how}): {sel.reason}")
    else:
        chosen = sel.candidates.get(sel.record.name)
        reason = sel.reason
        if chosen is not None and len(chosen.reason) > 60:  # its row above says it in full: not twice
            reason = reason.replace(chosen.reason, "its probe's reason, above")
        print(f"selected: {sel.record.name} ({sel.how}): {reason}")
        others = [n for n in sel.forceable if n != sel.record.name]  # what forcing would accept, best first
        if others:
            print(f"  to force another: MEMBACKEND_BACKEND={others[0]} (or backend = \"{others[0]}\" in "
                  f"membackend.toml); choices: {', '.join(others)}")
        else:
            print("  to force one whose probe turned it down: MEMBACKEND_BACKEND=<name> with MEMBACKEND_OVERRIDE_PROBE=1")


def _print_budgets(rows: list[dict[str, Any]]) -> None:
    print("budgets:")
    for b in rows:
        if "error" in b:
            print(f"  {b['device']}: error: {b['error']}")
        else:
            why = f" ({b['headroom_source']})" if b.get("headroom_source") else ""
            print(f"  {b['device']}: total {_size(b['total'])}, free {_size(b['free'])}, headroom {_size(b['headroom'])}"
                  f"{why}, usable {_size(b['usable'])}{' (unified pool)' if b['unified'] else ''} from {b['source']}")
            if "descriptors" in b:  # handles that hold file descriptors (ROCm 7.14)
                print(f"    descriptor limit: {b['descriptors']['started']}")
                if b["descriptors"]["line"]:
                    print(f"    {b['descriptors']['line']}")


def _print_selftest(t: dict[str, Any]) -> None:
    print(f"self-test on {t['backend']} ({t['device'] or 'no device'}):")
    base = t["steps"][0]["rss"]
    for s in t["steps"]:
        print(f"  {'ok  ' if s['ok'] else 'FAIL'} {s['step']:<9} RSS {_size(s['rss']):>10}"
              f" ({('+' if s['rss'] >= base else '') + _size(s['rss'] - base):>11})  ledger resident "
              f"{_size(s['ledger_resident'])}  {s['detail']}")
    if t.get("rss_note"):
        print(f"  ({t['rss_note']})")
    print("self-test: " + ("passed" if t["ok"] else "FAILED"))


# --------------------------------------------------------------------------- commands


def _setup() -> tuple[BackendManager, Machine, Selection]:
    settings = load_settings()
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    return mgr, machine, mgr.select(machine)


def run(command: str, as_json: bool) -> int:
    mgr, machine, sel = _setup()
    out: dict[str, Any] = {"version": __version__}
    rows = backends_report(mgr, sel)
    if command == "backends":
        out.update(backends=rows, selected=sel.record.name if sel.record else None, how=sel.how, reason=sel.reason,
                   tied=sel.tied)
        print(json.dumps(out, indent=2)) if as_json else _print_backends(rows, sel)
        return 0
    session = None
    if sel.record is not None:
        session = mgr.session(machine, selection=sel)
    if command == "budget":
        out["budgets"] = budgets_report(session) if session else []
        if session is not None:
            _close(session)
        if as_json:
            print(json.dumps(out, indent=2))
        else:
            _print_budgets(out["budgets"]) if session else print(f"membackend is disabled: {sel.reason}")
        return 0
    # doctor
    out.update(machine=machine_report(machine), settings=settings_report(mgr), backends=rows,
               selected=sel.record.name if sel.record else None, how=sel.how, reason=sel.reason, tied=sel.tied)
    if session is not None:
        out["budgets"] = budgets_report(session)
        out["kept_windows"] = kept_windows_report(session)
        _close(session)
        out["selftest"] = self_test(mgr, machine, sel)
    out["cache"] = cache_report(mgr)
    if as_json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(f"membackend {__version__}")
        _print_machine(machine)
        _print_settings(out["settings"])
        _print_backends(rows, sel)
        if session is not None:
            _print_budgets(out["budgets"])
            _print_selftest(out["selftest"])
            for row in out["kept_windows"]:
                print(f"kept address windows: {row['line']}")
        print(f"cache of dropped weights: {out['cache']['line']}")
    return 0 if session is None or out["selftest"]["ok"] else 1


def _close(session: Session) -> None:
    """Close a session the command opened; what it could not give back is said, never raised (the report
    is still printed)."""
    try:
        session.close()
    except MembackendError as exc:
        log.warning("membackend: closing the %s session: %s: %s", session.name, type(exc).__name__, exc)


def _comfyui(action: str, folder: str) -> int:
    from ._comfyui.install import install, uninstall

    try:
        done = (install if action == "install" else uninstall)(folder)
    except MembackendError as exc:
        print(f"membackend: {exc}", file=sys.stderr)
        return 2
    if action == "install":
        print(f"membackend: {'installed' if done.changed else 'already installed'}: {done.node}")
        print(f"  into this Python: {sys.executable} (it must be the one that runs ComfyUI)")
    else:
        print(f"membackend: {'removed' if done.changed else 'not installed'}: {done.node}")
        if done.left:
            print(f"  left {len(done.left)} file(s) membackend did not write in {done.node}: {', '.join(done.left)}")
    return 0


def _replay(a: argparse.Namespace) -> int:
    from .lab._replay.compare import replay

    try:
        if a.plot is not None:  # before the replay runs: an empty path, a wrong suffix or a missing extra
            from .lab._pictures import check_plot_target  # must not cost the run

            try:
                check_plot_target(a.plot)
            except MembackendError as exc:
                print(f"membackend: --plot: {exc}", file=sys.stderr)
                return 2
        comparison = replay(a.source, backend=a.backend, profile=a.profile, policy=a.policy, seeds=a.seeds,
                            record=a.record, run=a.run, keep_machine=a.keep_machine)
    except MembackendError as exc:  # a trace error names its file and line; a write error its file
        print(f"membackend: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # nothing of membackend's own should get here; if it does, name the file
        print(f"membackend: {shown(exc.filename or a.source)}: {os_reason(exc)}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(comparison.to_json(), indent=2, default=str))
    else:
        print(comparison.table())
    if a.plot is not None:
        from .lab._pictures import write_plot

        sc = comparison.scenario
        reported = f"reported in {sc.report}: " + next(iter(sc.reported.values())) if sc and sc.reported else None
        title = f"{sc.name} ({sc.report}) on {comparison.profile}" if sc else f"{a.source} on {comparison.profile}"
        try:
            path = write_plot(a.plot, comparison.timelines(), title=title, reported=reported)
        except MembackendError as exc:
            print(f"membackend: --plot: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # a full disk, a folder that cannot be written
            print(f"membackend: --plot {shown(a.plot)}: cannot write it: {os_reason(exc)}", file=sys.stderr)
            return 2
        print(f"timeline written to {path}", file=sys.stderr if a.json else sys.stdout)
    return 1 if comparison.violations else 0


def _bench(a: argparse.Namespace) -> int:
    from .lab.bench import format_bench, run_bench

    result = run_bench(quick=a.quick, seeds=a.seeds,
                       progress=None if a.json else (lambda step: print(f"  ... {step}", file=sys.stderr)))
    print(json.dumps(result, indent=2, default=str) if a.json else format_bench(result))
    return 0 if result["guarantees_held"] else 1


POSITIVE_MAX = 1_000_000  # seeds, runs: more is a typo (a million seeds would run for days)


def _positive(text: str) -> int:
    from ._settings import quoted

    digits = text.strip()
    n = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 7 else 0
    if not 1 <= n <= POSITIVE_MAX:
        raise argparse.ArgumentTypeError(f"a whole number from 1 to {POSITIVE_MAX:,} is accepted, got {quoted(text)}")
    return n


#: ``membackend --help``, above and below the list of commands (plain text: argparse prints it as written)
HELP_DESCRIPTION = ("membackend: a pluggable memory-backend layer for ComfyUI's dynamic VRAM. "
                    "What it sees on this machine, whether it works, and replays of memory workloads.")
HELP_EPILOG = ("exit codes: 0 ok; 1 the self-test failed, or a replay's plugin side broke a guarantee; "
               "2 a configuration error, a folder that is not a ComfyUI checkout, or a trace file that cannot "
               "be read or written (the message says which, and what is accepted). "
               "'membackend COMMAND --help' shows a command's options.")


def build_parser() -> argparse.ArgumentParser:
    """The command line: every command with a one-line description and its options."""
    parser = argparse.ArgumentParser(prog="membackend", description=HELP_DESCRIPTION, epilog=HELP_EPILOG)
    parser.add_argument("--version", action="version", version=f"membackend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=f"membackend {name}: {help_text}")

    for name, help_text in (("doctor", "machine facts, backends, budgets, then a self-test"),
                            ("backends", "every backend found, its probe result and the selection"),
                            ("budget", "each device's budget and its source")):
        p = command(name, help_text)
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
    comfy = command("comfyui", "add or remove the ComfyUI custom node that starts membackend")
    comfy.add_argument("action", choices=("install", "uninstall"))
    comfy.add_argument("folder", help="the ComfyUI checkout (the folder holding main.py)")
    rp = command("replay", "a seed report's workload or a recorded trace, stock vs plugin")
    from .lab._replay.scenarios import SCENARIOS  # names only: the replay machinery loads when a replay runs

    rp.add_argument("source", help=f"a built-in scenario ({', '.join(SCENARIOS)}) or a trace file written with "
                                   "MEMBACKEND_TRACE or --record")
    rp.add_argument("--backend", help="the plugin side's backend (default: the scenario's plugin, else the selection)")
    rp.add_argument("--profile", help="simulated profile (default: the scenario's, or the trace's)")
    rp.add_argument("--keep-machine", action="store_true",
                    help="apply the trace's (or scenario's) recorded machine changes, such as its device memory, on "
                         "another --profile too (default: that profile runs as it is)")
    rp.add_argument("--policy", choices=("stock", "plugin", "both"), default="both",
                    help="which side to run (default: both)")
    rp.add_argument("--seeds", type=_positive, help="seeds to run (a scenario's default otherwise)")
    rp.add_argument("--json", action="store_true", help="print the figures as JSON")
    rp.add_argument("--plot", metavar="FILE", help="timeline picture: .png/.svg/.pdf (needs membackend[plot]) "
                                                   "or .html (interactive, no extra needed)")
    rp.add_argument("--record", metavar="FILE", help="write seed 0's plugin run as a trace file (it replays to the "
                                                     "table of --seeds 1)")
    rp.add_argument("--run", type=_positive, help="which run of a trace file several processes appended to "
                                                  "(default: the last)")
    bp = command("bench", "the benchmark suite: side-by-side ratios and the seven replays")
    bp.add_argument("--json", action="store_true", help="print the figures as JSON")
    bp.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (a smoke run)")
    bp.add_argument("--seeds", type=_positive, help="seeds per replay (each scenario's default otherwise)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "comfyui":
        return _comfyui(args.action, args.folder)
    if args.command == "replay":
        return _replay(args)
    if args.command == "bench":
        return _bench(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args.command, args.json)
    except BackendDisabled as exc:
        print(f"membackend is disabled: {exc}")
        return 0
    except (MembackendError, ValueError) as exc:
        print(f"membackend: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
