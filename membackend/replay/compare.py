"""``membackend replay``: a scenario or a trace file, stock and plugin side by side, as one table.

:func:`replay` runs the sides for each seed and aggregates: counts are summed over the seeds,
memory figures are the worst seed's, times are the mean. :meth:`Comparison.table` prints the
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
from .traceformat import Trace, parse_lines, read_trace

__all__ = ["Comparison", "replay", "load_source", "FIGURES"]

GB = 10**9

#: the table's common rows: (key, label, how the seeds combine, unit divisor or None)
FIGURES: tuple[tuple[str, str, str, float | None], ...] = (
    ("peak_committed", "peak committed (GB)", "max", GB),
    ("committed_end", "committed after the run (GB)", "max", GB),
    ("alive_after_unload", "reservations alive after unload", "max", None),
    ("loaded", "bytes loaded (GB)", "sum", GB),
    ("refaulted", "bytes re-faulted (GB)", "sum", GB),
    ("load_seconds", "modelled load time (s)", "mean", 1.0),
    ("bugchecks", "simulated bugchecks", "sum", None),
    ("hazards", "frees racing pending work", "sum", None),
    ("creates", "handle creates", "sum", None),
    ("releases", "handle releases", "sum", None),
    ("spilled", "spilled to shared memory (GB)", "sum", GB),
    ("oom", "out-of-memory results", "sum", None),
)


def _combine(values: list[Any], how: str) -> Any:
    values = [v for v in values if v is not None]
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
        return _combine(values, "mean")

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
        lines = [head, f"profile {self.profile}, {self.seeds} seed{'s' if self.seeds != 1 else ''}"
                 + (" (counts summed, memory the worst seed, times the mean)" if self.seeds > 1 else "")]
        names = {side: (f"{side} ({runs[0].backend})" if runs else side) for side, runs in self.results.items()}
        stock_h, plugin_h = names.get("stock", "stock"), names.get("plugin", "plugin")
        rows = self.rows()
        width = max(len(r[1]) for r in rows)
        lines.append(f"  {'figure':<{width}}  {stock_h:>22}  {plugin_h:>24}  reported")
        for key, label, s, p, rep in rows:
            unit = next((u for k, _, _, u in FIGURES if k == key), 1.0 if key.endswith("seconds") else None)
            lines.append(f"  {label:<{width}}  {self._cell('stock', s, unit):>22}  "
                         f"{self._cell('plugin', p, unit):>24}  {rep}")
        for side, why in self.missing.items():
            lines.append(f"  {side}: not run: {why}")
        for side, runs in self.results.items():
            lost = [r.lost for r in runs if r.lost]
            if lost:
                lines.append(f"  {side}: the simulated machine was lost in {len(lost)} seed(s), first at {lost[0]}")
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

    def _cell(self, side: str, value: Any, unit: float | None) -> str:
        if side in self.missing or side not in self.results:
            return "not run"
        if value is None:
            return "-"
        if unit is None and isinstance(value, float) and value.is_integer():
            return f"{int(value):,}"  # a count averaged over one seed, or seeds that agree
        if isinstance(value, float) or unit not in (None, 1):
            return f"{value / (unit or 1):,.2f}"
        return f"{value:,}"


def load_source(source: str) -> tuple[Trace, Scenario | None, dict[str, Any]]:
    """A built-in scenario's name or a trace file's path → (trace for seed 0, scenario, profile changes)."""
    if source in SCENARIOS:
        sc = SCENARIOS[source]
        events, changes = sc.build(0)
        return Trace({"scenario": sc.name, "sim_profile": sc.profile}, events, sc.name), sc, {**sc.machine, **changes}
    if not Path(source).exists():
        get_scenario(source)  # raises UnknownScenario, listing the built-in ones
    trace = read_trace(source)
    scenario = SCENARIOS.get(trace.scenario or "")
    return trace, scenario, dict(trace.header.get("machine") or {})


def _progress(total: int) -> Callable[[int], None]:
    """A one-line progress bar on stderr for multi-seed runs (nothing for one seed)."""
    if total <= 1:
        return lambda done: None

    def show(done: int) -> None:
        filled = done * 30 // total
        end = "\n" if done == total else ""
        print(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} side runs", end=end, file=sys.stderr,
              flush=True)
    return show


def replay(source: str, *, backend: str | None = None, profile: str | None = None, policy: str = "both",
           seeds: int | None = None, record: str | None = None) -> Comparison:
    """Replay a built-in scenario or a trace file on a simulated profile, stock and plugin side by side.

    ``backend`` forces the plugin side's backend (default: the scenario's plugin, else membackend's
    selection); ``profile`` replaces the scenario's or the trace header's profile; ``policy`` is
    ``stock``, ``plugin`` or ``both``; ``seeds`` runs seeds ``0..seeds-1`` of a scenario (a
    trace file replays as recorded, once per seed); ``record`` writes the first seed's plugin run
    (or the stock run, when only stock runs) as a trace file that replays to the same table.
    A plugin that is not installed leaves its column "not run", with how to install it.
    """
    if policy not in ("stock", "plugin", "both"):
        raise ReplayError(f"policy {policy!r}; accepted: stock, plugin, both")
    trace, scenario, changes = load_source(source)
    seeds = seeds if seeds is not None else (scenario.default_seeds if scenario and source in SCENARIOS else 1)
    if not isinstance(seeds, int) or seeds < 1:
        raise ReplayError(f"seeds must be a whole number >= 1, got {seeds!r}")
    prof = profile or (scenario.profile if scenario else None) or trace.header.get("sim_profile")
    if not prof:
        raise ReplayError(f"{source}: the trace names no simulated profile (it was recorded on real hardware); "
                          "pass --profile, one of: wddm-6gb, rocm-win-2gpu, gb10-128gb, h200")
    plugin_backend = backend or (scenario.plugin if scenario else None)
    sides = SIDES if policy == "both" else (policy,)
    comparison = Comparison(source, scenario, prof, seeds, trace)
    progress, done = _progress(seeds * len(sides) if seeds > 1 else 1), 0
    for seed in range(seeds):
        if seed and scenario is not None and source in SCENARIOS:
            events, drawn = scenario.build(seed)
            trace_s, changes_s = Trace(trace.header, events, source), {**scenario.machine, **drawn}
        else:
            trace_s, changes_s = trace, changes
        recorded_side = "plugin" if "plugin" in sides else sides[0]
        for side in sides:
            if side in comparison.missing:
                continue
            rec = record if (record is not None and seed == 0 and side == recorded_side) else None
            try:
                result = run_side(trace_s, side, profile=prof, backend=plugin_backend if side == "plugin" else None,
                                  changes=changes_s, record=rec)
            except PluginMissing as exc:
                comparison.missing[side] = str(exc)
                continue
            comparison.results.setdefault(side, []).append(result)
            done += 1
            progress(done)
    if record is not None and Path(record).exists():
        # a replay of the recorded file must find the scenario again and replay the same workload
        parse_lines(Path(record).read_text().splitlines(), record)
    return comparison
