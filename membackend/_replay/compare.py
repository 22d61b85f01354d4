"""``membackend replay``: a scenario or a trace file, stock and plugin side by side, as one table.

:func:`replay` runs the sides for each seed and aggregates: totals (bytes loaded, events) are
summed over the seeds, memory levels are the worst seed's, times are the mean; a scenario's own
rows sum whole numbers and average the rest. :meth:`Comparison.table` prints the
figures next to the report's; :meth:`Comparison.to_json` gives the same figures as JSON;
:attr:`Comparison.violations` lists every guarantee the plugin side broke (the CLI exits 1).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .engine import SIDES, PluginMissing, ReplayError, SideResult, run_side
from .scenarios import SCENARIOS, Scenario, get_scenario
from .timeline import Timeline
from .traceformat import Trace, read_trace

__all__ = ["Comparison", "replay", "load_source", "format_cells", "FIGURES"]

GB = 10**9

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
    ends_unloaded = any(e["event"] in ("unload_all", "idle") for e in trace.events[-2:])
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
            "profile_changes": self.changes, "seeds": self.seeds,
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
    if key == "device_memory":
        return f"{value / (1 << 30):g} GiB"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def load_source(source: str, run: int | None = None) -> tuple[Trace, Scenario | None, dict[str, Any]]:
    """A built-in scenario's name or a trace file's path → (trace for seed 0, scenario, profile changes)."""
    if source in SCENARIOS:
        sc = SCENARIOS[source]
        events, changes = sc.build(0)
        return Trace({"scenario": sc.name, "sim_profile": sc.profile}, events, sc.name), sc, {**sc.machine, **changes}
    if not Path(source).exists():
        get_scenario(source)  # raises UnknownScenario, listing the built-in ones
    trace = read_trace(source, run)
    scenario = SCENARIOS.get(trace.scenario or "")
    return trace, scenario, dict(trace.header.get("machine") or {})


def _check_record_path(record: str) -> None:
    p = Path(record)
    if p.is_dir() or not p.parent.is_dir():
        raise ReplayError(f"--record {record!r}: {'a folder' if p.is_dir() else 'its folder does not exist'}; "
                          "accepted: a file path in an existing folder")


def _progress(total: int) -> Callable[[int], None]:
    """A one-line progress bar on stderr for multi-seed runs (nothing for one seed)."""
    if total <= 1:
        return lambda done, last=False: None

    def show(done: int, last: bool = False) -> None:
        filled = done * 30 // total
        end = "\n" if done == total or last else ""
        print(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} side runs", end=end, file=sys.stderr,
              flush=True)
    return show


def replay(source: str, *, backend: str | None = None, profile: str | None = None, policy: str = "both",
           seeds: int | None = None, record: str | None = None, run: int | None = None) -> Comparison:
    """Replay a built-in scenario or a trace file on a simulated profile, stock and plugin side by side.

    ``backend`` forces the plugin side's backend (default: the scenario's plugin, else, for a
    trace replayed on the profile it was recorded on, the backend that recorded it, else
    membackend's selection); ``profile`` replaces the scenario's or the trace header's profile;
    ``policy`` is ``stock``, ``plugin`` or ``both``; ``seeds`` runs seeds ``0..seeds-1`` of a
    scenario (a trace file replays as recorded: one seed); ``run`` picks a run of a trace file
    several processes appended to (default: the last). ``record`` writes seed 0's plugin run (or
    the stock run, when only stock runs) as a trace file that replays to the table of one seed.
    A scenario's plugin that is not installed leaves its column "not run", with how to install it;
    a ``backend`` asked for by name that is not installed raises :class:`PluginMissing`.
    """
    from .._drivers.open import profile_names

    if policy not in ("stock", "plugin", "both"):
        raise ReplayError(f"policy {policy!r}; accepted: stock, plugin, both")
    if record is not None:
        _check_record_path(record)
    trace, scenario, changes = load_source(source, run)
    builtin = scenario is not None and source in SCENARIOS
    if seeds is not None and (not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1):
        raise ReplayError(f"seeds must be a whole number >= 1, got {seeds!r}")
    if not builtin and seeds not in (None, 1):
        raise ReplayError(f"{source} is a trace file: it replays as recorded, once; --seeds applies to the "
                          f"built-in scenarios ({', '.join(SCENARIOS)})")
    seeds = seeds or (scenario.default_seeds if builtin else 1)
    recorded_on = trace.header.get("sim_profile")
    prof = profile or (scenario.profile if builtin else recorded_on) or (scenario.profile if scenario else None)
    if not prof:
        raise ReplayError(f"{source}: the trace names no simulated profile (it was recorded on real hardware); "
                          f"pass --profile, one of: {', '.join(profile_names())}")
    if prof not in profile_names():
        raise ReplayError(f"profile {prof!r} is unknown; accepted: {', '.join(profile_names())}")
    plugin_backend = backend or (scenario.plugin if builtin else None)
    if plugin_backend is None and not builtin and prof == recorded_on:
        plugin_backend = trace.header.get("backend") if trace.header.get("backend") != "aimdo_stock" else None
    sides = SIDES if policy == "both" else (policy,)
    comparison = Comparison(source, scenario, prof, seeds, trace, changes)
    progress, done = _progress(seeds * len(sides) if seeds > 1 else 1), 0
    recorded_side = "plugin" if "plugin" in sides else sides[0]
    for seed in range(seeds):
        if seed and builtin:
            events, drawn = scenario.build(seed)
            trace_s, changes_s = Trace(trace.header, events, source), {**scenario.machine, **drawn}
        else:
            trace_s, changes_s = trace, changes
        for side in sides:
            if side in comparison.missing:
                continue
            rec = record if (record is not None and seed == 0 and side == recorded_side) else None
            try:
                result = run_side(trace_s, side, profile=prof, backend=plugin_backend if side == "plugin" else None,
                                  changes=changes_s, record=rec)
            except PluginMissing as exc:
                if backend is not None:
                    progress(done, last=True)
                    raise  # asked for by name: a configuration error, not a missing column
                comparison.missing[side] = str(exc)
                continue
            comparison.results.setdefault(side, []).append(result)
            done += 1
            progress(done, last=seed == seeds - 1 and side == sides[-1])
    return comparison
