"""Running a trace through the residency policy and a backend on a simulated machine, per side.

* **stock**: today's ComfyUI + comfy-aimdo — :class:`~membackend.lab._replay.stock.AimdoLoadManager`
  over :class:`~membackend.lab._replay.stock.AimdoStockVmm` (32 MiB pages, budget as aimdo reads it,
  no fence tokens: aimdo has none).
* **plugin**: membackend — :class:`~membackend._residency.ResidencyManager` over the backend the
  scenario names (found through its entry point, as membackend finds it), or over what
  membackend selects on the profile; every copy records an event token, so frees wait for it.

Both sides run the same events on a fresh simulation of the same profile. A ``copy`` event
runs only when the fault before it backed new pages (the cast path copies a layer whose
signature changed); its recorded seconds advance the modelled clock, and the simulated device
runs the copy on a stream, so a free that does not wait for it is a hazard the simulation sees.
A fault that finds no memory is streamed instead (the copy still costs its time), as ComfyUI
does. A simulated bugcheck or crash ends that side's run, as it would end the machine; so does
a typed failure the side cannot go on from (an address quota refused, an unload that failed):
``stopped`` says where. An event the trace gets wrong (a model never registered, a range outside
its model) is a :class:`~membackend.lab._replay.traceformat.TraceError` naming its line.

A side holds one event at a time (a file's events are streamed) and a bounded timeline
(:data:`MAX_SAMPLES_PER_DEVICE`), so its memory does not grow with the trace's length. A record
file (``record``) that cannot be written -- a full disk -- ends the run at that event: everything
the side reserved is released, and the failure is a
:class:`~membackend.lab._replay.traceformat.TraceWriteError` naming the file, never one of the backend.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..._drivers.open import machine_for, open_sim_variant, simulated_failures
from ..._ledger import Ledger
from ..._residency import ResidencyManager
from ..._session import Session
from ..._settings import load_settings
from ..._settings.rules import did_you_mean, quoted
from ..._trace import TraceObserver
from ...platform import Platform
from ...types import Device, MembackendError
from ...types import _PluginMissing as PluginMissing
from ...types import _ReplayError as ReplayError
from ...types import _TraceError as TraceError
from ...types import _TraceWriteError as TraceWriteError
from .stock import AimdoLoadManager, AimdoStockVmm
from .timeline import Marker, Sample, Timeline
from .traceformat import Trace, shown_path

__all__ = ["SideResult", "ReplayError", "run_side", "check_plugin", "SIDES", "PluginMissing", "MAX_SAMPLES_PER_DEVICE",
           "PROGRESS_EVERY"]

SIDES = ("stock", "plugin")

#: the most timeline samples a side keeps per device; past twice this the timeline is thinned
#: (each run of four samples keeps its lowest and highest resident), so memory stays bounded
MAX_SAMPLES_PER_DEVICE = 20_000
#: a side's ``progress`` callback is called after every this many events (and once at the end)
PROGRESS_EVERY = 10_000


@dataclass
class SideResult:
    """What one side's run did. Byte figures are bytes; ``committed`` is what the platform charges
    the process (Windows private commit) where it charges reservations, else the device memory in
    use (resident plus what the backend keeps for reuse)."""

    side: str
    backend: str
    profile: str
    committed_start: int = 0
    committed_end: int | None = None
    peak_committed: int = 0
    alive_after_unload: int = 0  # reservations alive at the end of the run
    reserved_after_unload: int = 0
    loaded: int = 0  # bytes newly backed by faults (each must be copied in)
    refaulted: int = 0  # of those, bytes of ranges faulted before (loaded again)
    load_seconds: float = 0.0  # modelled: the recorded time of every copy that had to run
    oom: int = 0
    oom_by_model: dict[str, int] = field(default_factory=dict)
    typed_errors: list[str] = field(default_factory=list)  # driver errors a fault raised (the layer streamed)
    bugchecks: int = 0
    hazards: int = 0  # unmaps/releases the simulated driver saw race pending work
    creates: int = 0
    releases: int = 0
    spilled: int = 0
    lost: str | None = None  # the simulated machine ended (bugcheck, crash) at this event
    stopped: str | None = None  # a typed failure this side could not go on from, at this event
    runs: list[dict[str, Any]] = field(default_factory=list)  # per workflow: seconds (copies + compute), loaded
    unloads: list[dict[str, Any]] = field(default_factory=list)  # after each full unload / unload_all
    timeline: Timeline = field(default_factory=lambda: Timeline(""))
    notes: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """The table's figures (no timeline), JSON-ready."""
        out = dataclasses.asdict(self)
        out.pop("timeline")
        return out


# --------------------------------------------------------------------------- sessions


def _distribution(backend: str) -> str:
    return "membackend-" + backend.replace("_", "-")


def _check_installed(manager: Any, backend: str) -> None:
    """:class:`PluginMissing` unless ``backend`` is one of ``manager``'s records, saying what to do: a plugin
    the replays know (a scenario's) gets the command that installs it; one installed but broken, its
    reason; any other name the closest installed one -- never an install hint for a package that does not
    exist (``cuda_wdm`` is a typo of ``cuda_wddm``, not a plugin called ``membackend-cuda-wdm``)."""
    from .scenarios import SCENARIOS

    if backend in manager.records:
        return
    installed = sorted(manager.records)
    if backend in manager.broken:
        raise PluginMissing(f"backend {quoted(backend)} cannot be used: broken: {manager.broken[backend]}")
    if backend in {sc.plugin for sc in SCENARIOS.values() if sc.plugin}:
        raise PluginMissing(f"backend {quoted(backend)} is not installed (pip install {_distribution(backend)}); "
                            f"installed: {', '.join(installed)}")
    raise PluginMissing(f"backend {quoted(backend)} is not installed{did_you_mean(backend, installed)} "
                        f"(installed: {', '.join(installed)})")


def _plugin_session(profile: str, backend: str | None, changes: dict[str, Any]) -> Session:
    from ..._backends.vmm import VmmBackend

    settings = load_settings(sim_profile=profile, backend=backend, disable=False)
    name, platform = _plugin_platform(settings, profile, backend)
    vendor = platform.vendor or "cuda"
    driver = open_sim_variant(profile, hold_bytes=False, **changes)  # modelled copies: sizes and times
    if driver.vendor != vendor and platform.vendor:
        raise ReplayError(f"backend {name!r} drives {vendor} devices; profile {profile!r} simulates "
                          f"{driver.vendor}")
    machine = machine_for(settings)
    # the simulated machine's facts (its OS, each device's driver model) decide what the platform's knobs
    # resolve to, e.g. page_in_sync="wddm" on a simulated Windows profile, not this process's OS
    built = VmmBackend(platform, driver, machine=lambda: machine)
    return Session(built, machine=machine, ledger=Ledger())


def _plugin_platform(settings: Any, profile: str, backend: str | None) -> tuple[str, Platform]:
    """The plugin side's backend (``backend``, else what membackend selects on ``profile``): its name
    and its platform. :class:`PluginMissing` when it is not installed, :class:`ReplayError` when it
    is not built on the VMM mechanism (only those run on a simulated profile)."""
    from ..._backends.vmm import VmmBackend
    from ..._manager import BackendManager

    manager = BackendManager(settings)
    if backend is not None:
        backend = settings.backend  # as the settings took it: any case of a name is that name
        _check_installed(manager, backend)
    record = manager.records[backend] if backend else manager.select(machine_for(settings)).record
    if record is None:  # nothing selected: only with membackend switched off, which this session is not
        raise ReplayError(f"membackend selects no backend on profile {profile!r}; pass --backend")
    plugin = record.plugin
    if not isinstance(plugin, VmmBackend):
        vmm = [n for n, r in sorted(manager.records.items()) if isinstance(r.plugin, VmmBackend)]
        chosen = "" if backend else f"membackend selects {record.name!r} on profile {profile!r}; "
        raise ReplayError(f"{chosen}backend {record.name!r} is not built on the VMM mechanism, so it cannot run "
                          f"on a simulated profile; replays accept platform backends: pass --backend with one of "
                          f"{', '.join(vmm)}")
    return record.name, plugin.platform


def check_plugin(profile: str, backend: str | None, changes: dict[str, Any] | None = None) -> None:
    """Raise what :func:`run_side` would raise for the plugin side's ``backend`` on ``profile``
    (:class:`PluginMissing`, :class:`ReplayError`) without running anything."""
    _plugin_session(profile, backend, dict(changes or {})).close()


def _stock_session(profile: str, changes: dict[str, Any]) -> Session:
    settings = load_settings(sim_profile=profile)
    driver: Any = open_sim_variant(profile, hold_bytes=False, **changes)  # modelled copies: sizes and times
    wddm = driver.sim.profile.wddm  # a simulated driver: it has ``sim``
    backend = AimdoStockVmm(driver, budget_source="wddm" if wddm else "device")
    return Session(backend, machine=machine_for(settings), ledger=Ledger())


# --------------------------------------------------------------------------- the run


class _Run:
    """One side's replay state."""

    def __init__(self, session: Session, manager: ResidencyManager, result: SideResult, record_copies: bool):
        self.session, self.manager, self.result = session, manager, result
        self.backend: Any = cast(Any, session.backend)  # a VMM backend over a simulated driver: its driver
        self.driver = self.backend.driver
        self.sim = self.driver.sim
        self.record_copies = record_copies
        self.models: dict[str, Any] = {}
        self.devices: list[Device] = [Device(self.driver.vendor, i) for i in range(len(self.sim.devices))]
        #: per model and device, the faults not yet copied into: (offset, size, mapped; -1 streamed)
        self.pending_copies: dict[tuple[str, Device], list[tuple[int, int, int]]] = {}
        self.seen: set[tuple[str, Device, int, int]] = set()
        self.t = 0.0
        self.streams: dict[int, Any] = {}
        self.run: dict[str, Any] | None = None
        #: per device, (sequence number, sample): merged into the timeline in order by :meth:`finish_timeline`
        self.samples: dict[str, list[tuple[int, Sample]]] = {}
        self.sequence = 0
        self._states: list[Any] = []
        self._states_key: tuple | None = None
        self.result.committed_start = self.committed_total()
        self.sample()

    # ---- mapping a trace's devices onto the profile
    def device(self, name: str) -> Device:
        d = Device.parse(name)
        if d.kind == self.driver.vendor and d.index < len(self.devices):
            return d
        mapped = self.devices[d.index % len(self.devices)]
        note = f"{d} replayed on {mapped}"
        if note not in self.result.notes:
            self.result.notes.append(note)
        return mapped

    # ---- figures
    def committed_total(self, states: list[Any] | None = None) -> int:
        """What the process is charged now (``states``: the devices' driver states, if just read)."""
        states = [self.session.inspect(d) for d in self.devices] if states is None else states
        if states and states[0] is not None and states[0].committed is not None:
            return states[0].committed  # process-wide (Windows private commit)
        return sum(s.resident + s.held for s in states if s is not None)

    def driver_states(self, accounts: list[Any]) -> list[Any]:
        """Each device's driver state, read again only when something may have changed it: a driver
        call since the last read, or a ledger figure (a window pooled or reused without a call).
        Reading the simulated driver's tables costs time in proportion to what is mapped; most events
        of a long trace (copies, compute, faults of resident pages) change neither."""
        key = (sum(self.sim.faults.calls.values()),
               tuple((a.reserved, a.resident, a.reservations_alive) for a in accounts))
        if key != self._states_key:
            self._states, self._states_key = [self.session.inspect(d) for d in self.devices], key
        return self._states

    def sample(self) -> None:
        step = self.result.timeline.next_step(self.t, bugchecks=self.sim.bugchecks, raced_frees=self.sim.use_after_free,
                                              oom=self.result.oom)  # the picture's x, and its failure marks
        accounts = [self.session.ledger.account(d) for d in self.devices]
        states = self.driver_states(accounts)
        committed = self.committed_total(states)
        self.result.peak_committed = max(self.result.peak_committed, committed)
        for i, d in enumerate(self.devices):
            acct, state = accounts[i], states[i]
            per_device = None
            if state is not None:
                per_device = committed if (state.committed is not None and i == 0) else (
                    None if state.committed is not None else state.resident + state.held)
            self.keep(Sample(self.t, str(d), acct.reserved, acct.resident, per_device, step))

    def keep(self, s: Sample) -> None:
        """Add a sample to its device's series. The timeline is drawn as steps (each value holds until
        the next sample), so a sample that repeats the two before it only moves the plateau's end;
        past twice :data:`MAX_SAMPLES_PER_DEVICE`, each run of four keeps its lowest and highest."""
        series = self.samples.setdefault(s.device, [])
        self.sequence += 1
        values = (s.reserved, s.resident, s.committed)
        if len(series) >= 2 and all((p.reserved, p.resident, p.committed) == values for _, p in series[-2:]):
            series[-1] = (self.sequence, s)
            return
        series.append((self.sequence, s))
        if len(series) > 2 * MAX_SAMPLES_PER_DEVICE:
            thinned = []
            for i in range(0, len(series), 4):
                bucket = series[i:i + 4]
                low = min(bucket, key=lambda item: item[1].resident)
                high = max(bucket, key=lambda item: item[1].resident)
                thinned += sorted({low, high}, key=lambda item: item[0])
            series[:] = thinned

    def finish_timeline(self) -> None:
        """Write the kept samples into the result's timeline, in the order they were taken."""
        self.result.timeline.samples = [s for _, s in heapq.merge(*self.samples.values(), key=lambda item: item[0])]

    def mark(self, kind: str, label: str, device: str | None = None) -> None:
        self.result.timeline.markers.append(Marker(self.t, kind, label, device, step=self.result.timeline.steps))

    def after_unload(self, label: str) -> None:
        resident = sum(self.session.ledger.account(d).resident for d in self.devices)
        alive = sum(self.session.ledger.account(d).reservations_alive for d in self.devices)
        self.result.unloads.append({"model": label, "t": self.t, "resident": resident, "alive": alive,
                                    "committed": self.committed_total()})

    # ---- events
    def apply(self, e: dict[str, Any]) -> None:
        getattr(self, "on_" + e["event"])(e)

    def on_register(self, e):
        owner = None
        if e.get("owner"):
            if e["owner"] not in self.models:
                raise TraceError(f"owner {e['owner']!r} of model {e['model']!r} is not registered before it")
            owner = self.models[e["owner"]]
        devices = list(dict.fromkeys(self.device(d) for d in e["devices"]))  # two may map onto one
        self.models[e["model"]] = self.manager.register(e["model"], e["bytes"], devices, e.get("kind") or "other",
                                                       owner=owner)

    def on_use(self, e):
        self.manager.use([self.models[m] for m in e["models"]], workflow=e.get("workflow"))
        label = e.get("workflow") or "+".join(e["models"])
        if self.run is None or self.run["workflow"] != label:
            self.run = {"workflow": label, "start": self.t, "seconds": 0.0, "loaded": 0}
            self.result.runs.append(self.run)
            self.mark("workflow", label)

    def on_fault(self, e):
        model, dev = self.models[e["model"]], self.device(e["device"])
        pending = self.pending_copies.setdefault((e["model"], dev), [])
        try:
            f = self.manager.fault(model, e["offset"], e["bytes"], dev)
        except MembackendError as exc:
            if isinstance(exc, ValueError):
                raise  # the trace's range or device is wrong: a TraceError for the caller
            self.result.typed_errors.append(f"{type(exc).__name__}: {exc}")  # ComfyUI streams the layer
            f = None
        if f is None or not f.ok:
            if f is not None:
                self.result.oom += 1
                self.result.oom_by_model[e["model"]] = self.result.oom_by_model.get(e["model"], 0) + 1
            pending.append((e["offset"], e["bytes"], -1))  # streamed
            return
        pending.append((e["offset"], e["bytes"], f.mapped))
        del pending[:-64]  # a prefetch runs a few layers ahead, never far
        span = (e["model"], dev, e["offset"], e["bytes"])
        if f.mapped:
            self.result.loaded += f.mapped
            if self.run is not None:
                self.run["loaded"] += f.mapped
            if span in self.seen:
                self.result.refaulted += f.mapped
        self.seen.add(span)

    def on_copy(self, e):
        dev = self.device(e["device"])
        pending = self.pending_copies.get((e["model"], dev), [])
        lo, hi = e["offset"], e["offset"] + e["bytes"]
        # the latest fault whose range this copy writes (prefetch may fault several layers first)
        match = next((i for i in range(len(pending) - 1, -1, -1)
                      if pending[i][0] < hi and lo < pending[i][0] + pending[i][1]), None)
        if match is None:
            return  # no fault asked for this range: nothing to copy into
        offset, size, mapped = pending.pop(match)
        if mapped == 0:
            return  # the pages were resident: the signature matched, nothing is copied
        self.result.load_seconds += e["seconds"]
        self.advance(e["seconds"], busy=False)
        if mapped < 0:
            return  # streamed through a temporary buffer: it costs time, touches no page of the range
        model = self.models[e["model"]]
        r = model.reservation(dev)
        start, end = max(offset, lo), min(offset + size, hi)
        self.driver.set_device(dev.index)  # a copy runs on a stream of the device it writes
        stream = self.streams.get(dev.index)
        if stream is None:
            stream = self.streams[dev.index] = self.driver.stream_create()
        self.driver.memcpy_htod_async(r.base + start, 0, end - start, stream)
        if self.record_copies:  # the copy's event: frees of this reservation wait for it (G2)
            self.manager.record(model, self.backend.fence_token(r, stream), dev)

    def on_compute(self, e):
        self.advance(e["seconds"], busy=True)

    def advance(self, seconds: float, busy: bool) -> None:
        """Move the modelled clock. A copy is asynchronous: the simulated device queues it (and
        finishes it at its own bandwidth), so only compute lets simulated time pass."""
        self.t += seconds
        if self.run is not None:
            self.run["seconds"] += seconds
        if busy:
            self.sim.advance(seconds)  # the host runs ahead while the device computes

    def on_unpin(self, e):
        self.manager.unpin(self.models[e["model"]], e["offset"], e["bytes"], self.device(e["device"]))

    def on_full_unload(self, e):
        self.manager.full_unload(self.models[e["model"]])
        self.mark("unload", e["model"])
        self.after_unload(e["model"])

    def on_unload_all(self, e):
        self.manager.unload_all()
        self.mark("unload_all", "unload all")
        self.after_unload("unload all")

    def on_unregister(self, e):
        self.manager.unregister(self.models.pop(e["model"]))

    def on_free_memory(self, e):
        self.manager.free_memory(e["bytes"], self.device(e["device"]))

    def on_shed(self, e):
        self.manager.shed(self.models[e["model"]], e["bytes"], self.device(e["device"]), floor=e.get("floor", 0))

    def on_prioritize(self, e):
        self.manager.prioritize(self.models[e["model"]])

    def on_deprioritize(self, e):
        self.manager.deprioritize(self.models[e["model"]])

    def on_set_watermark(self, e):
        self.manager.set_watermark(self.models[e["model"]], e["limit"], self.device(e["device"]))

    def on_idle(self, e):
        self.manager.on_idle()
        if self.result.unloads:
            self.after_unload("idle")


class _RecordingTracer(TraceObserver):
    """The tracer of ``run_side(record=...)``: a write that fails (a full disk) is kept in
    :attr:`failed` instead of raised into the verb being traced -- it is the record file's failure,
    not the backend's -- and nothing more is written; ``run_side`` ends the run at that event and
    raises :class:`TraceWriteError` (so no warning is logged: the error says it)."""

    def __init__(self, path: str | Path, **header: Any):
        try:
            super().__init__(path, **header)  # nothing is left open when it raises
        except OSError as exc:  # the file cannot be opened (a FIFO nobody reads), or its header not written
            raise TraceWriteError(path, exc, shown_path(path)) from None

    def _stopped(self, exc: OSError) -> None:
        pass  # run_side raises TraceWriteError once everything is released


def _fresh_record_path(record: str) -> Path:
    """Make way for a new record file: a file (or a link) already there is removed; anything else
    (a device such as /dev/full, a pipe) is written to as it is, never removed."""
    path = Path(record)
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
    except OSError as exc:
        raise TraceWriteError(path, exc, shown_path(path)) from None
    return path


def run_side(trace: Trace, side: str, *, profile: str, backend: str | None = None,
             changes: dict[str, Any] | None = None, record: str | None = None,
             progress: Callable[[int], None] | None = None) -> SideResult:
    """Replay ``trace`` on ``side`` (``"stock"`` or ``"plugin"``) on a fresh simulation of ``profile``
    (``changes``: profile fields to replace, see ``open_sim_variant``). ``backend`` names the
    plugin side's backend (None: what membackend selects on the profile). ``record``: write this
    side's own trace (``MEMBACKEND_TRACE`` format, with the workload's header) to that path.
    ``progress(events_done)`` is called every :data:`PROGRESS_EVERY` events and once at the end.

    Raises :class:`PluginMissing` when ``backend`` is not installed, :class:`TraceError` for an event
    the trace gets wrong, and :class:`TraceWriteError` when ``record`` cannot be written (the run
    ends there and its file is removed). Whatever is raised, every reservation the side made is
    released first."""
    if side not in SIDES:
        raise ReplayError(f"side {side!r}; accepted: {', '.join(SIDES)}")
    changes = dict(changes or {})
    session, tracer = _open_side(trace, side, profile, backend, changes, record)
    manager = AimdoLoadManager(session, tracer=tracer) if side == "stock" else ResidencyManager(session, tracer=tracer)
    result = SideResult(side, session.backend.name, profile, timeline=Timeline(side))
    run = _Run(session, manager, result, record_copies=side == "plugin")
    try:
        _replay_events(run, trace, tracer, progress)
        run.finish_timeline()
        _take_end_figures(run)
    finally:
        # stock releases reservations only when its models are collected: after the figures, as ComfyUI would
        run.models.clear()
        del manager, run
        gc.collect()
        _close_side(session, tracer, lost=result.lost is not None)
    failed = _record_failure(tracer, record)
    if failed is not None:
        raise failed
    return result


#: the header fields a record file writes anew (the rest of the workload's header is kept)
_OWN_HEADER = ("time", "event", "format", "version", "membackend", "sim_profile", "machine", "backend")


def _open_side(trace: Trace, side: str, profile: str, backend: str | None, changes: dict[str, Any],
               record: str | None) -> tuple[Session, _RecordingTracer | None]:
    """The side's session on a fresh simulation and, with ``record``, the tracer writing it (the
    session then reports to it). A record file that cannot be opened closes the session first."""
    session = _stock_session(profile, changes) if side == "stock" else _plugin_session(profile, backend, changes)
    if record is None:
        return session, None
    # what MEMBACKEND_TRACE writes: the verbs and the policy's records
    kept = {k: v for k, v in trace.header.items() if k not in _OWN_HEADER}
    try:
        path = _fresh_record_path(record)
        tracer = _RecordingTracer(path, **kept, sim_profile=profile, machine=changes, backend=session.backend.name)
    except TraceWriteError:
        session.close()  # nothing reserved yet; the driver's contexts go back
        raise
    traced = Session(session.backend, machine=session.machine, ledger=session.ledger, observers=[tracer],
                     tracer=tracer)
    return traced, tracer


def _replay_events(run: _Run, trace: Trace, tracer: _RecordingTracer | None,
                   progress: Callable[[int], None] | None) -> None:
    """Apply the trace's events in order, sampling after each, until the end, the end of the side's
    machine, a failure it cannot go on from, or a record file that could not be written."""
    fatal = simulated_failures()
    done = 0
    for n, (line, e) in enumerate(trace.numbered()):
        if not _apply_event(run, trace, tracer, fatal, (n, line, e)):
            break
        if tracer is not None and tracer.failed is not None:
            break  # the record file is full: raised by run_side, once everything is released
        run.sample()
        done = n + 1
        if progress is not None and done % PROGRESS_EVERY == 0:
            progress(done)
    if progress is not None and done % PROGRESS_EVERY:
        progress(done)


def _apply_event(run: _Run, trace: Trace, tracer: _RecordingTracer | None, fatal: tuple[type[BaseException], ...],
                 at: tuple[int, int | None, dict[str, Any]]) -> bool:
    """Apply one event (``at``: its index, line and fields); False when the side cannot go on: its
    simulated machine ended (``lost``) or a typed failure stopped it (``stopped``). What the trace
    gets wrong is raised as a :class:`TraceError` naming the event."""
    n, line, e = at
    try:
        if tracer is not None and e["event"] in ("copy", "compute"):
            _trace_input(tracer, run.manager, e)
        run.apply(e)
    except fatal as exc:
        run.result.lost = f"{trace.where(n, line, e)}: {type(exc).__name__}: {exc}"
        if hasattr(run.backend, "carry_on"):
            run.backend.carry_on = True  # nothing after the end may bugcheck again
        return False
    except KeyError as exc:
        raise TraceError(f"{trace.where(n, line, e)}: model {exc.args[0]!r} was never registered (or was "
                         "unregistered before)") from None
    except TraceError as exc:
        raise TraceError(f"{trace.where(n, line, e)}: {exc}") from None
    except MembackendError as exc:
        if isinstance(exc, ValueError):  # bad input in the trace (a range, a size, a device, a kind)
            raise TraceError(f"{trace.where(n, line, e)}: {type(exc).__name__}: {exc}") from None
        run.result.stopped = f"{trace.where(n, line, e)}: {type(exc).__name__}: {exc}"
        return False
    return True


def _take_end_figures(run: _Run) -> None:
    """What the side still holds after its last event, and what the simulated driver counted."""
    result, sim = run.result, run.sim
    for d in run.devices:
        acct = run.session.ledger.account(d)
        result.alive_after_unload += acct.reservations_alive
        result.reserved_after_unload += acct.reserved
    result.committed_end = run.committed_total()
    result.bugchecks, result.hazards, result.spilled = sim.bugchecks, sim.use_after_free, sim.spilled_bytes
    calls = sim.faults.calls
    result.creates = calls.get("cuMemCreate", 0) + calls.get("hipMemCreate", 0)
    result.releases = calls.get("cuMemRelease", 0) + calls.get("hipMemRelease", 0)


def _close_side(session: Session, tracer: _RecordingTracer | None, *, lost: bool) -> None:
    """Close the session (not after the simulated machine ended) and the record file."""
    if not lost:
        try:
            session.close()
        except Exception:  # a side that failed may not close cleanly; its figures are taken
            pass
    if tracer is not None:
        tracer.close()


def _record_failure(tracer: _RecordingTracer | None, record: str | None) -> TraceWriteError | None:
    """The error to raise when the record file could not be written, its partial file removed: what
    was written of it is no trace (a replay would stop at its end)."""
    if tracer is None or tracer.failed is None or record is None:
        return None
    try:
        if Path(record).is_file():
            Path(record).unlink()
    except OSError:
        pass
    return TraceWriteError(record, tracer.failed, shown_path(record))


def _trace_input(tracer: TraceObserver, manager: ResidencyManager, e: dict[str, Any]) -> None:
    """Copies and compute steps are the workload's, not the policy's: written as they came."""
    tracer.event(e["event"], policy=manager.policy_name, **{k: v for k, v in e.items() if k not in ("event", "policy",
                                                                                               "time")})
