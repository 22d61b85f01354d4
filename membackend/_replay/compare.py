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
:class:`~membackend._replay.traceformat.TraceError` naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..types import ConfigError
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
        names = {side: (f"{side} ({runs[0].backend})" if runs else side) for side, runs in self.results.items()}
        stock_h, plugin_h = names.get("stock", "stock"), names.get("plugin", "plugin")
        rows = self.rows()
        width = max(len(r[1]) for r in rows)
        lines.append(f"  {'figure':<{width}}  {stock_h:>22}  {plugin_h:>24}  reported")
        for key, label, s, p, rep in rows:
            unit = next((u for k, _, _, u in FIGURES if k == key), 1.0 if key.endswith("seconds") else None)
            cells = format_cells([s, p], unit, [side in self.results and side not in self.missing for side in SIDES])
            lines.append(f"  {label:<{width}}  {cells[0]:>22}  {cells[1]:>24}  {rep}")
        for side, why in self.missing.items():
            lines.append(f"  {side}: not run: {why}")
        for side, runs in self.results.items():
            lost = [r.lost for r in runs if r.lost]
            if lost:
                lines.append(f"  {side}: the simulated machine was lost in {len(lost)} seed(s), first at {lost[0]}")
            stopped = [r.stopped for r in runs if r.stopped]
            if stopped:
                lines.append(f"  {side}: the run stopped in {len(stopped)} seed(s), first at {stopped[0]}")
            notes = sorted({n for r in runs for n in r.notes})
            if notes:
                lines.append(f"  {side}: {'; '.join(notes)}")
        if self.stock_reproduces is not None:
            lines.append(f"  stock reproduces the reported failure: {'yes' if self.stock_reproduces else 'no'}")
        if "plugin" in self.results:
            v = self.violations
            g = sc.guarantee if sc else "the guarantees"
            lines.append(f"  plugin holds {g}: yes" if not v else "  plugin breaks: " + "; ".join(v))
        return "\n".join(lines)



def format_cells(values: list[Any], unit: float | None, ran: list[bool]) -> list[str]:
    """One row's values as text, side by side: byte figures in ``unit``; a row holding a fractional
    value prints every value with two decimals, so the sides read alike (120.00 vs 9.00)."""
    nums = [v / unit if unit not in (None, 1, 1.0) and isinstance(v, (int, float)) else v for v in values]
    decimals = unit not in (None, 1, 1.0) or any(
        isinstance(v, float) and not v.is_integer() for v in nums if not isinstance(v, bool))
    out = []
    for v, r in zip(nums, ran):
        if not r:
            out.append("not run")
        elif v is None:
            out.append("-")
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            out.append(str(v))
        else:
            out.append(f"{v:,.2f}" if decimals else f"{int(v):,}")
    return out


def _describe_change(key: str, value: Any) -> str:
    if key == "device_memory" and isinstance(value, (int, float)):
        return f"{value / (1 << 30):g} GiB"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _looks_like_a_path(source: str) -> bool:
    """Scenario names are plain words: a name with a folder separator or a suffix is meant as a file."""
    return "/" in source or os.sep in source or "." in source


def load_source(source: str, run: int | None = None) -> tuple[Trace, Scenario | None, dict[str, Any]]:
    """A built-in scenario's name or a trace file's path → (trace for seed 0, scenario, profile changes).

    A file that does not exist is a :class:`TraceError` ("no such file") when ``source`` reads as
    a path, else an ``UnknownScenario`` listing the built-in ones."""
    if source in SCENARIOS:
        sc = SCENARIOS[source]
        events, changes = sc.build(0)
        return Trace({"scenario": sc.name, "sim_profile": sc.profile}, events, sc.name), sc, {**sc.machine, **changes}
    p = Path(source)
    if not p.exists() and not p.is_symlink() and not _looks_like_a_path(source):
        get_scenario(source)  # raises UnknownScenario, listing the built-in ones
    trace = read_trace(source, run)  # a path that is not there: "no such file"
    scenario = SCENARIOS.get(trace.scenario or "")
    return trace, scenario, dict(trace.header.get("machine") or {})


def _check_record_path(record: str, source: str) -> None:
    p = Path(record)
    if p.is_dir() or not p.parent.is_dir():
        raise ReplayError(f"--record {record!r}: {'a folder' if p.is_dir() else 'its folder does not exist'}; "
                          "accepted: a file path in an existing folder")
    try:
        same = Path(source).exists() and p.exists() and os.path.samefile(source, record)
    except OSError:
        same = False
    if same:
        raise ReplayError(f"--record {record!r} is the trace being replayed; accepted: another file")


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
    from .._drivers.open import open_sim_variant

    base = open_sim_variant(profile, hold_bytes=False).sim.profile
    kinds = {f.name: str(f.type) for f in dataclasses.fields(base)}
    for key, value in changes.items():
        if key == "device_memory":
            if not (type(value) is int and 1 <= value <= MAX_COUNT):
                raise TraceError(f"{where}: 'machine' field 'device_memory' must be a whole number of bytes "
                                 f"from 1 to 2**63 - 1, got {value!r}")
            continue
        kind = kinds.get(key)
        if kind is None or kind not in _FIELD_KINDS or key in ("name", "vendor"):
            accepted = sorted([k for k, v in kinds.items() if v in _FIELD_KINDS and k not in ("name", "vendor")]
                              + ["device_memory"])
            raise TraceError(f"{where}: 'machine' field {key!r} is not a profile field a trace may change; "
                             f"accepted: {', '.join(accepted)}")
        if not _fits(kind, value) or (key in ("copy_bandwidth", "granularity") and not value):
            raise TraceError(f"{where}: 'machine' field {key!r} must be {_FIELD_KINDS[kind]}"
                             f"{' (not 0)' if key in ('copy_bandwidth', 'granularity') else ''}, got {value!r}")
    try:
        open_sim_variant(profile, hold_bytes=False, **changes)
    except (ConfigError, ValueError, TypeError) as exc:
        raise TraceError(f"{where}: 'machine': {exc}") from None


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
    from .._drivers.open import profile_names
    from .engine import check_plugin

    if policy not in ("stock", "plugin", "both"):
        raise ReplayError(f"policy {policy!r}; accepted: stock, plugin, both")
    if record is not None:
        _check_record_path(record, source)
    trace, scenario, changes = load_source(source, run)
    builtin = scenario is not None and source in SCENARIOS
    if seeds is not None and (not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1):
        raise ReplayError(f"seeds must be a whole number >= 1, got {seeds!r}")
    if not builtin and seeds not in (None, 1):
        raise ReplayError(f"{source} is a trace file: it replays as recorded, once; --seeds applies to the "
                          f"built-in scenarios ({', '.join(SCENARIOS)})")
    seeds = seeds or (scenario.default_seeds if builtin else 1)
    recorded_on = trace.header.get("sim_profile")
    home = scenario.profile if builtin else (recorded_on or (scenario.profile if scenario else None))
    prof = profile or home
    if not prof:
        raise ReplayError(f"{trace.header_where()}: the trace names no simulated profile (it was recorded on real "
                          f"hardware); pass --profile, one of: {', '.join(profile_names())}")
    if prof not in profile_names():
        if profile is None:  # the header's
            raise TraceError(f"{trace.header_where()}: header 'sim_profile' {prof!r} is no simulated profile; "
                             f"accepted: {', '.join(profile_names())} (or pass --profile)")
        raise ReplayError(f"profile {prof!r} is unknown; accepted: {', '.join(profile_names())}")
    where = f"scenario {scenario.name}" if builtin else trace.header_where()
    not_applied: dict[str, Any] = {}
    if changes and prof != home and not keep_machine:
        not_applied, changes = changes, {}
    _check_machine(changes, prof, where)
    plugin_backend = backend or (scenario.plugin if builtin else None)
    from_header = False
    if plugin_backend is None and not builtin and prof == recorded_on:
        plugin_backend = trace.header.get("backend") if trace.header.get("backend") != "aimdo_stock" else None
        from_header = plugin_backend is not None
    sides = SIDES if policy == "both" else (policy,)
    if "plugin" in sides and (backend is not None or from_header):
        try:  # before any side runs: a backend named but not there is the caller's (or the trace's) mistake
            check_plugin(prof, plugin_backend, changes)
        except ReplayError as exc:
            if not from_header:
                raise
            raise TraceError(f"{trace.header_where()}: header 'backend': {exc}; or pass --backend to replay "
                             "with another") from None
    comparison = Comparison(source, scenario, prof, seeds, trace, changes, not_applied=not_applied,
                            recorded_on=home)
    progress = _Progress(seeds * len(sides), len(trace.events), several_seeds=seeds > 1)
    recorded_side = "plugin" if "plugin" in sides else sides[0]
    try:
        for seed in range(seeds):
            if seed and builtin:
                events, drawn = scenario.build(seed)
                drawn = {**scenario.machine, **drawn} if (prof == home or keep_machine) else {}
                trace_s, changes_s = Trace(trace.header, events, source), drawn
            else:
                trace_s, changes_s = trace, changes
            for side in sides:
                if side in comparison.missing:
                    progress.side_done(last=seed == seeds - 1 and side == sides[-1])
                    continue
                rec = record if (record is not None and seed == 0 and side == recorded_side) else None
                try:
                    result = run_side(trace_s, side, profile=prof,
                                      backend=plugin_backend if side == "plugin" else None,
                                      changes=changes_s, record=rec, progress=progress.side(side))
                except PluginMissing as exc:
                    if backend is not None:
                        raise  # asked for by name: a configuration error, not a missing column
                    comparison.missing[side] = str(exc)
                    progress.side_done(last=seed == seeds - 1 and side == sides[-1])
                    continue
                comparison.results.setdefault(side, []).append(result)
                progress.side_done(last=seed == seeds - 1 and side == sides[-1])
    except BaseException:
        progress.stop()
        raise
    return comparison
