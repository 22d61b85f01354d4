"""``membackend replay``: a scenario or a trace file, stock and plugin side by side, as one table.

:func:`replay` runs the sides for each seed and aggregates: totals (bytes loaded, events) are
summed over the seeds, memory levels are the worst seed's, times are the mean; a scenario's own
rows sum whole numbers and average the rest. :meth:`Comparison.table` prints the
figures next to the report's; :meth:`Comparison.to_json` gives the same figures as JSON;
:attr:`Comparison.violations` lists every guarantee the plugin side broke (the CLI exits 1).

The profile is the one asked for: a trace's (or scenario's) recorded ``machine`` changes apply
only on the profile it was recorded on, unless ``keep_machine`` says to apply them elsewhere too
(the table says what was left out). Everything a trace file names -- its profile, its backend, its
machine fields -- is checked before any side runs; what it gets wrong is a
:class:`~membackend.lab._replay.traceformat.TraceError` naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._settings.rules import NAME_MAX, did_you_mean, os_reason, quoted, shown
from ...types import ConfigError
from .engine import SIDES, PluginMissing, ReplayError, SideResult, run_side
from .scenarios import SCENARIOS, Scenario, get_scenario
from .timeline import Timeline
from .traceformat import MAX_COUNT, Trace, TraceError, read_trace

__all__ = ["Comparison", "replay", "load_source", "format_cells", "FIGURES", "LONG_TRACE_EVENTS"]

GB = 10**9

#: a trace of at least this many events reports its progress on stderr, event by event
LONG_TRACE_EVENTS = 100_000

#: the table's common rows: (key, label, how the seeds combine, unit divisor or None)
FIGURES: tuple[tuple[str, str, str, float | None], ...] = (
    ("peak_committed", "peak committed (GB)", "max", GB),
    ("committed_end", "committed after the run (GB)", "max", GB),
    ("alive_after_unload", "reservations alive after unload", "max", None),
    ("loaded", "bytes loaded (GB)", "sum", GB),
    ("refaulted", "bytes re-faulted (GB)", "sum", GB),
    ("load_seconds", "modelled load time (s)", "mean", 1.0),
    ("typed_errors", "typed driver errors (layer streamed)", "sum", None),
    ("bugchecks", "simulated bugchecks", "sum", None),
    ("hazards", "frees racing pending work", "sum", None),
    ("creates", "handle creates", "sum", None),
    ("releases", "handle releases", "sum", None),
    ("spilled", "spilled to shared memory (GB)", "sum", GB),
    ("oom", "out-of-memory results", "sum", None),
)


def _combine(values: list[Any], how: str) -> Any:
    values = [len(v) if isinstance(v, list) else v for v in values if v is not None]
    if not values:
        return None
    if how == "sum":
        return sum(values)
    if how == "max":
        return max(values)
    return sum(values) / len(values)


def _generic_holds(side: SideResult, trace: Trace) -> list[str]:
    """What every replay's plugin side must hold, whatever the trace."""
    out = []
    if side.lost:
        out.append(f"the simulated machine was lost at {side.lost}")
    if side.stopped:
        out.append(f"the run stopped at {side.stopped}")
    if side.bugchecks:
        out.append(f"G2: {side.bugchecks} simulated bugcheck(s)")
    if side.hazards:
        out.append(f"G2: {side.hazards} free(s) or release(s) raced pending work")
    ends_unloaded = any(name in ("unload_all", "idle") for name in trace.tail)
    if ends_unloaded and side.alive_after_unload:
        out.append(f"G1: {side.alive_after_unload} reservation(s) alive after unloading everything")
    return out


@dataclass
class Comparison:
    """One replay: per side the seeds' results and their aggregate."""

    source: str
    scenario: Scenario | None
    profile: str
    seeds: int
    trace: Trace
    changes: dict[str, Any] = field(default_factory=dict)  # profile fields replaced (seed 0's)
    results: dict[str, list[SideResult]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # side -> why it did not run
    #: the recorded machine changes not applied (the replay runs on another profile), and where they were recorded
    not_applied: dict[str, Any] = field(default_factory=dict)
    recorded_on: str | None = None

    # ---- figures
    def value(self, side: str, key: str) -> Any:
        runs = self.results.get(side)
        if not runs:
            return None
        for k, _, how, _ in FIGURES:
            if k == key:
                return _combine([getattr(r, k) for r in runs], how)
        values = []
        for r in runs:
            values += [v for k, _, v in self.key_figures(r) if k == key]
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in values if v is not None)
        return _combine(values, "sum" if whole else "mean")

    def key_figures(self, result: SideResult) -> list[tuple[str, str, Any]]:
        return self.scenario.key_figures(result) if self.scenario else []

    def rows(self) -> list[tuple[str, str, Any, Any, str]]:
        """``(key, label, stock, plugin, reported)`` for every figure, the scenario's own last."""
        reported = self.scenario.reported if self.scenario else {}
        out = [(k, label, self.value("stock", k), self.value("plugin", k), reported.get(k, ""))
               for k, label, _, _ in FIGURES]
        any_run = next((runs[0] for runs in self.results.values() if runs), None)
        if any_run is not None:
            for k, label, _ in self.key_figures(any_run):
                out.append((k, label, self.value("stock", k), self.value("plugin", k), reported.get(k, "")))
        return out

    @property
    def violations(self) -> list[str]:
        """Every guarantee the plugin side broke, once (empty when it held or did not run)."""
        seen: dict[str, None] = {}
        for r in self.results.get("plugin", []):
            for v in _generic_holds(r, self.trace) + (self.scenario.plugin_holds(r) if self.scenario else []):
                seen.setdefault(v, None)
        return list(seen)

    @property
    def stock_reproduces(self) -> bool | None:
        """Whether the stock side shows the reported failure in at least one seed (None: not asked)."""
        runs = self.results.get("stock")
        if not runs or self.scenario is None:
            return None
        return any(self.scenario.stock_reproduces(r) for r in runs)

    def timelines(self) -> dict[str, Timeline]:
        """The first seed's timeline per side."""
        return {side: runs[0].timeline for side, runs in self.results.items() if runs}

    # ---- output
    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "scenario": self.scenario.name if self.scenario else None,
            "report": self.scenario.report if self.scenario else None, "profile": self.profile,
            "profile_changes": self.changes, "profile_changes_not_applied": self.not_applied,
            "seeds": self.seeds,
            "backends": {side: runs[0].backend for side, runs in self.results.items() if runs},
            "missing": self.missing,
            "figures": {k: {"label": label, "stock": s, "plugin": p, "reported": rep or None}
                        for k, label, s, p, rep in self.rows()},
            "violations": self.violations, "stock_reproduces": self.stock_reproduces,
            "per_seed": {side: [r.figures() for r in runs] for side, runs in self.results.items()},
        }

    def table(self) -> str:
        """The printed table: what ran where, one row per figure (stock, plugin, reported), then what
        did not run or stopped and whether each side showed what it must."""
        return "\n".join(self._table_head() + self._table_rows() + self._table_notes())

    def _table_head(self) -> list[str]:
        sc = self.scenario
        head = f"{sc.name} ({sc.report}): {sc.title}" if sc else f"trace {self.source}"
        changed = ", ".join(f"{k}={_describe_change(k, v)}" for k, v in self.changes.items())
        lines = [head, f"profile {self.profile}" + (f" ({changed})" if changed else "")
                 + f", {self.seeds} seed{'s' if self.seeds != 1 else ''}"
                 + (" (totals summed, memory levels the worst seed, times the mean)" if self.seeds > 1 else "")]
        if self.not_applied:
            left = ", ".join(f"{k}={_describe_change(k, v)}" for k, v in self.not_applied.items())
            lines.append(f"  recorded on {self.recorded_on or 'another profile'} with {left}: not applied on "
                         f"{self.profile} (--keep-machine applies them)")
        return lines

    def _table_rows(self) -> list[str]:
        # the stock side is comfy-aimdo's own mechanism, modelled (lab._replay.stock), not a backend one could force
        names = {side: ("stock (comfy-aimdo)" if side == "stock" else f"{side} ({runs[0].backend})") if runs else side
                 for side, runs in self.results.items()}
        stock_h, plugin_h = names.get("stock", "stock"), names.get("plugin", "plugin")
        rows = self.rows()
        width = max(len(r[1]) for r in rows)
        lines = [f"  {'figure':<{width}}  {stock_h:>22}  {plugin_h:>24}  reported"]
        ran = [side in self.results and side not in self.missing for side in SIDES]
        for key, label, s, p, rep in rows:
            unit = next((u for k, _, _, u in FIGURES if k == key), 1.0 if key.endswith("seconds") else None)
            cells = format_cells([s, p], unit, ran)
            lines.append(f"  {label:<{width}}  {cells[0]:>22}  {cells[1]:>24}  {rep}")
        return lines

    def _table_notes(self) -> list[str]:
        lines = [f"  {side}: not run: {why}" for side, why in self.missing.items()]
        for side, runs in self.results.items():
            lines += _side_notes(side, runs)
        if self.stock_reproduces is not None:
            lines.append(f"  stock reproduces the reported failure: {'yes' if self.stock_reproduces else 'no'}")
        if "plugin" in self.results:
            v = self.violations
            g = self.scenario.guarantee if self.scenario else "the guarantees"
            lines.append(f"  plugin holds {g}: yes" if not v else "  plugin breaks: " + "; ".join(v))
        return lines


def _side_notes(side: str, runs: list[SideResult]) -> list[str]:
    """Where a side's machine was lost or its run stopped (the first seed's place), and its notes."""
    lines = []
    lost = [r.lost for r in runs if r.lost]
    if lost:
        lines.append(f"  {side}: the simulated machine was lost in {len(lost)} seed(s), first at {lost[0]}")
    stopped = [r.stopped for r in runs if r.stopped]
    if stopped:
        lines.append(f"  {side}: the run stopped in {len(stopped)} seed(s), first at {stopped[0]}")
    notes = sorted({n for r in runs for n in r.notes})
    if notes:
        lines.append(f"  {side}: {'; '.join(notes)}")
    return lines


def format_cells(values: list[Any], unit: float | None, ran: list[bool]) -> list[str]:
    """One row's values as text, side by side: byte figures in ``unit``; a row holding a fractional
    value prints every value with two decimals, so the sides read alike (120.00 vs 9.00)."""
    scaled = unit not in (None, 1, 1.0)
    nums = [v / unit if scaled and unit is not None and isinstance(v, (int, float)) else v for v in values]
    decimals = scaled or any(isinstance(v, float) and not v.is_integer() for v in nums if not isinstance(v, bool))
    return [_cell(v, decimals) if r else "not run" for v, r in zip(nums, ran)]


def _cell(value: Any, decimals: bool) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,.2f}" if decimals else f"{int(value):,}"


def _describe_change(key: str, value: Any) -> str:
    if key == "device_memory" and isinstance(value, (int, float)):
        return f"{value / GB:.4g} GB"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _looks_like_a_path(source: str) -> bool:
    """Scenario names are plain words: a name with a folder separator or a suffix is meant as a file."""
    return "/" in source or os.sep in source or "." in source


def load_source(source: str, run: int | None = None) -> tuple[Trace, Scenario | None, dict[str, Any]]:
    """A built-in scenario's name or a trace file's path → (trace for seed 0, scenario, profile changes).

    A file that does not exist is a :class:`TraceError` ("no such file") when ``source`` reads as
    a path, else an ``UnknownScenario`` listing the built-in ones; an empty (or blank) ``source`` names
    neither, and is a :class:`ReplayError` saying so (as a path it would be the current folder)."""
    if not isinstance(source, str) or not source.strip():
        raise ReplayError(f"{quoted(source)} names no built-in scenario and no file; accepted: a built-in scenario "
                          f"({', '.join(SCENARIOS)}) or the path of a trace file")
    if source in SCENARIOS:
        sc = SCENARIOS[source]
        events, changes = sc.build(0)
        return Trace({"scenario": sc.name, "sim_profile": sc.profile}, events, sc.name), sc, {**sc.machine, **changes}
    p = Path(source)
    try:
        there = p.exists() or p.is_symlink()
    except (OSError, ValueError):  # a name too long for the file system, a folder this user may not search:
        there = True  # a path all the same, which read_trace words
    if not there and not _looks_like_a_path(source):
        get_scenario(source)  # raises UnknownScenario, listing the built-in ones
    trace = read_trace(source, run)  # a path that is not there: "no such file"
    scenario = SCENARIOS.get(trace.scenario or "")
    return trace, scenario, dict(trace.header.get("machine") or {})


def _check_record_path(record: str, source: str) -> None:
    p = Path(record)
    try:
        folder = p.is_dir()
        lost = not folder and not p.parent.is_dir()
    except (OSError, ValueError) as exc:  # a name too long, a folder this user may not search, a NUL byte
        why = os_reason(exc) if isinstance(exc, OSError) else "not a path (it holds a NUL byte)"
        raise ReplayError(f"--record {shown(record)}: cannot be looked up: {why}; accepted: a file path in an "
                          "existing folder") from None
    if folder or lost:
        raise ReplayError(f"--record {shown(record)}: {'a folder' if folder else 'its folder does not exist'}; "
                          "accepted: a file path in an existing folder")
    try:
        same = Path(source).exists() and p.exists() and os.path.samefile(source, record)
    except (OSError, ValueError):
        same = False
    if same:
        raise ReplayError(f"--record {shown(record)} is the trace being replayed; accepted: another file")


#: what each profile field a trace's ``machine`` may change accepts, by the field's annotation
_FIELD_KINDS = {"int": "a whole number >= 0", "float": "a finite number >= 0", "bool": "true or false",
                "str": "a string", "int | None": "a whole number >= 0 or null"}


def _fits(kind: str, value: Any) -> bool:
    whole = type(value) is int and 0 <= value <= MAX_COUNT
    if kind == "int":
        return whole
    if kind == "int | None":
        return value is None or whole
    if kind == "float":
        return type(value) in (int, float) and math.isfinite(value) and value >= 0
    if kind == "bool":
        return type(value) is bool
    return kind == "str" and isinstance(value, str)


def _check_machine(changes: dict[str, Any], profile: str, where: str) -> None:
    """Each changed profile field is one the simulation takes, with a value of its kind; else a
    :class:`TraceError` at ``where`` saying what is accepted."""
    from ..._drivers.open import open_sim_variant

    driver: Any = open_sim_variant(profile, hold_bytes=False)  # a simulated driver: it has ``sim``
    base = driver.sim.profile
    kinds = {f.name: str(f.type) for f in dataclasses.fields(base)}
    for key, value in changes.items():
        _check_field(key, value, kinds, where)
    try:
        open_sim_variant(profile, hold_bytes=False, **changes)
    except (ConfigError, ValueError, TypeError) as exc:
        raise TraceError(f"{where}: 'machine': {exc}") from None


def _check_field(key: str, value: Any, kinds: dict[str, str], where: str) -> None:
    """One changed profile field (``kinds``: each field's annotation), or :class:`TraceError`."""
    if key == "device_memory":
        if not (type(value) is int and 1 <= value <= MAX_COUNT):
            raise TraceError(f"{where}: 'machine' field 'device_memory' must be a whole number of bytes "
                             f"from 1 to 2**63 - 1, got {value!r}")
        return
    kind = _field_kind(key, kinds, where)
    not_zero = key in ("copy_bandwidth", "granularity")
    if not _fits(kind, value) or (not_zero and not value):
        raise TraceError(f"{where}: 'machine' field {key!r} must be {_FIELD_KINDS[kind]}"
                         f"{' (not 0)' if not_zero else ''}, got {value!r}")


def _field_kind(key: str, kinds: dict[str, str], where: str) -> str:
    """The kind of profile field ``key`` is, when a trace may change it; else :class:`TraceError`."""
    kind = kinds.get(key)
    if kind is None or kind not in _FIELD_KINDS or key in ("name", "vendor"):
        accepted = sorted([k for k, v in kinds.items() if v in _FIELD_KINDS and k not in ("name", "vendor")]
                          + ["device_memory"])
        raise TraceError(f"{where}: 'machine' field {key!r} is not a profile field a trace may change; "
                         f"accepted: {', '.join(accepted)}")
    return kind


class _Progress:
    """One progress line on stderr: side runs done (when several seeds run), and events done
    within a side for a long trace (at least :data:`LONG_TRACE_EVENTS`). Nothing otherwise."""

    def __init__(self, side_runs: int, events: int, several_seeds: bool):
        self.side_runs, self.events, self.finished = side_runs, events, 0
        self.long = events >= LONG_TRACE_EVENTS
        self.enabled = several_seeds or self.long
        self.width = 0  # of the last line shown: a shorter one is padded to cover it

    def _show(self, fraction: float, text: str, end: str = "") -> None:
        filled = min(30, int(fraction * 30))
        line = f"  [{'#' * filled}{'.' * (30 - filled)}] {text}"
        print(f"\r{line.ljust(self.width)}", end=end, file=sys.stderr, flush=True)
        self.width = 0 if end else len(line)

    def side(self, name: str):
        """The callback for one side's run (None when no progress is shown)."""
        if not self.long:
            return None
        run = self.finished + 1

        def show(done: int) -> None:
            self._show((self.finished + done / max(self.events, 1)) / self.side_runs,
                       f"{name}: {done:,}/{self.events:,} events (side run {run}/{self.side_runs})")
        return show

    def side_done(self, last: bool = False) -> None:
        self.finished += 1
        if self.enabled:
            end = "\n" if self.finished == self.side_runs or last else ""
            self._show(self.finished / self.side_runs, f"{self.finished}/{self.side_runs} side runs", end)

    def stop(self) -> None:
        """End the line early (an error follows)."""
        if self.enabled and self.finished < self.side_runs:
            print(file=sys.stderr, flush=True)


def replay(source: str, *, backend: str | None = None, profile: str | None = None, policy: str = "both",
           seeds: int | None = None, record: str | None = None, run: int | None = None,
           keep_machine: bool = False) -> Comparison:
    """Replay a built-in scenario or a trace file on a simulated profile, stock and plugin side by side.

    ``backend`` forces the plugin side's backend (default: the scenario's plugin, else, for a
    trace replayed on the profile it was recorded on, the backend that recorded it, else
    membackend's selection); ``profile`` replaces the scenario's or the trace header's profile;
    ``policy`` is ``stock``, ``plugin`` or ``both``; ``seeds`` runs seeds ``0..seeds-1`` of a
    scenario (a trace file replays as recorded: one seed); ``run`` picks a run of a trace file
    several processes appended to (default: the last). ``record`` writes seed 0's plugin run (or
    the stock run, when only stock runs) as a trace file that replays to the table of one seed.

    The recorded ``machine`` changes (a scenario's, a trace header's) apply on the profile they
    were recorded on; on another ``profile`` that profile runs as it is, unless ``keep_machine``
    (:attr:`Comparison.not_applied` lists what was left out). A scenario's plugin that is not
    installed leaves its column "not run", with how to install it; a ``backend`` asked for by name,
    or named by the trace's header, that is not installed raises :class:`PluginMissing` (a
    :class:`TraceError` naming the header's line for the header's). A long trace reports its
    progress on stderr.
    """
    if policy not in ("stock", "plugin", "both"):
        raise ReplayError(f"policy {policy!r}; accepted: stock, plugin, both")
    if record is not None:
        _check_record_path(record, source)
    trace, scenario, changes = load_source(source, run)
    builtin = scenario if scenario is not None and source in SCENARIOS else None
    seeds = _seed_count(source, builtin, seeds)
    home = _home_profile(builtin, scenario, trace)
    prof = _checked_profile(profile, home, trace)
    changes, not_applied = _applied(changes, elsewhere=prof != home and not keep_machine)
    _check_machine(changes, prof, f"scenario {builtin.name}" if builtin else trace.header_where())
    plugin_backend, from_header = _plugin_backend(backend, builtin, trace, prof)
    sides = SIDES if policy == "both" else (policy,)
    if "plugin" in sides and (backend is not None or from_header):
        _check_named_plugin(trace, prof, plugin_backend, changes, from_header)
    comparison = Comparison(source, scenario, prof, seeds, trace, changes, not_applied=not_applied,
                            recorded_on=home)
    _run_seeds(comparison, _Sides(builtin, prof == home or keep_machine, sides, plugin_backend, backend is not None,
                                  record))
    return comparison


def _seed_count(source: str, builtin: Scenario | None, seeds: int | None) -> int:
    """How many seeds run: ``seeds`` (a whole number >= 1, for a built-in scenario only), else the
    scenario's default, else (a trace file) one."""
    if seeds is not None and (not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1):
        raise ReplayError(f"seeds must be a whole number >= 1, got {seeds!r}")
    if builtin is None and seeds not in (None, 1):
        raise ReplayError(f"{source} is a trace file: it replays as recorded, once; --seeds applies to the "
                          f"built-in scenarios ({', '.join(SCENARIOS)})")
    return seeds or (builtin.default_seeds if builtin else 1)


def _home_profile(builtin: Scenario | None, scenario: Scenario | None, trace: Trace) -> str | None:
    """Where the workload was recorded: a built-in scenario's profile, else the trace header's, else
    the profile of the scenario the trace names (None: real hardware)."""
    if builtin is not None:
        return builtin.profile
    return trace.header.get("sim_profile") or (scenario.profile if scenario else None)


def _applied(changes: dict[str, Any], *, elsewhere: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(applied, not applied)`` of the recorded machine changes: none apply ``elsewhere`` (on
    another profile than the one they were recorded on, without --keep-machine)."""
    if changes and elsewhere:
        return {}, changes
    return changes, {}


def _checked_profile(asked: str | None, home: str | None, trace: Trace) -> str:
    """The profile the replay runs on: ``asked``, else ``home`` (the scenario's, or the one the trace
    was recorded on); a simulated one, else :class:`ReplayError` (:class:`TraceError` for the header's)."""
    from ..._drivers.open import profile_names

    names = profile_names()
    if asked is not None:  # profile names are lower-case: any case of one is that one (as sim_profile)
        asked = asked.strip().lower() if isinstance(asked, str) and len(asked) <= 2 * NAME_MAX else asked
        if asked not in names:  # an empty --profile too: it is no profile, not "the scenario's"
            raise ReplayError(f"profile {quoted(asked)} is unknown{did_you_mean(asked, names)}; accepted: "
                              f"{', '.join(names)}")
        return asked
    if not home:
        raise ReplayError(f"{trace.header_where()}: the trace names no simulated profile (it was recorded on real "
                          f"hardware); pass --profile, one of: {', '.join(names)}")
    if home not in names:  # the header's
        raise TraceError(f"{trace.header_where()}: header 'sim_profile' {quoted(home)} is no simulated profile"
                         f"{did_you_mean(home, names)}; accepted: {', '.join(names)} (or pass --profile)")
    return home


def _plugin_backend(backend: str | None, builtin: Scenario | None, trace: Trace, prof: str) -> tuple[str | None, bool]:
    """The plugin side's backend and whether the trace's header named it: ``backend``, else the
    built-in scenario's plugin, else, on the profile the trace was recorded on, the backend that
    recorded it (unless that was stock), else None (membackend's selection)."""
    plugin_backend = backend or (builtin.plugin if builtin else None)
    if plugin_backend is None and builtin is None and prof == trace.header.get("sim_profile"):
        named = trace.header.get("backend")
        plugin_backend = named if named != "aimdo_stock" else None
        return plugin_backend, plugin_backend is not None
    return plugin_backend, False


def _check_named_plugin(trace: Trace, prof: str, plugin_backend: str | None, changes: dict[str, Any],
                        from_header: bool) -> None:
    """Before any side runs: a backend named but not there is the caller's (or the trace's) mistake."""
    from .engine import check_plugin

    try:
        check_plugin(prof, plugin_backend, changes)
    except ReplayError as exc:
        if not from_header:
            raise
        raise TraceError(f"{trace.header_where()}: header 'backend': {exc}; or pass --backend to replay "
                         "with another") from None


@dataclass(frozen=True)
class _Sides:
    """How :func:`replay` runs each seed's sides."""

    builtin: Scenario | None  # the built-in scenario: seeds after 0 build their own workload
    machine_kept: bool  # a seed's drawn machine changes apply (on the scenario's profile, or --keep-machine)
    sides: tuple[str, ...]
    plugin_backend: str | None
    backend_named: bool  # asked for by name: not installed is a configuration error, not a missing column
    record: str | None


def _run_seeds(comparison: Comparison, how: _Sides) -> None:
    """Run every seed's sides into ``comparison``, with a progress line on stderr when long."""
    seeds, sides = comparison.seeds, how.sides
    progress = _Progress(seeds * len(sides), len(comparison.trace.events), several_seeds=seeds > 1)
    recorded_side = "plugin" if "plugin" in sides else sides[0]
    try:
        for seed in range(seeds):
            trace, changes = _seed_workload(comparison, how, seed)
            for side in sides:
                record = how.record if (seed == 0 and side == recorded_side) else None
                _run_one(comparison, how, side, trace, changes, record, progress)
                progress.side_done(last=seed == seeds - 1 and side == sides[-1])
    except BaseException:
        progress.stop()
        raise


def _seed_workload(comparison: Comparison, how: _Sides, seed: int) -> tuple[Trace, dict[str, Any]]:
    """The trace and profile changes of ``seed``: seed 0's as loaded, a built-in scenario's others drawn."""
    if seed and how.builtin is not None:
        events, drawn = how.builtin.build(seed)
        drawn = {**how.builtin.machine, **drawn} if how.machine_kept else {}
        return Trace(comparison.trace.header, events, comparison.source), drawn
    return comparison.trace, comparison.changes


def _run_one(comparison: Comparison, how: _Sides, side: str, trace: Trace, changes: dict[str, Any],
             record: str | None, progress: _Progress) -> None:
    """One side's run of one seed, its result added to ``comparison``; a plugin that is not installed
    (and was not asked for by name) leaves the side missing, and it runs no more seeds."""
    if side in comparison.missing:
        return
    try:
        result = run_side(trace, side, profile=comparison.profile,
                          backend=how.plugin_backend if side == "plugin" else None,
                          changes=changes, record=record, progress=progress.side(side))
    except PluginMissing as exc:
        if how.backend_named:
            raise  # asked for by name: a configuration error, not a missing column
        comparison.missing[side] = str(exc)
        return
    comparison.results.setdefault(side, []).append(result)
