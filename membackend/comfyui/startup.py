"""Start-up inside ComfyUI: selection and one log line before torch, then the ``init_devices`` hook.

ComfyUI's ``main.py`` runs, in this order: arguments, ``comfy_aimdo.control.init``,
the custom nodes' prestartup scripts, the first torch import, then (when dynamic
VRAM is on) ``comfy_aimdo.control.init_devices(...)`` followed by the patcher swap,
then the custom nodes. So:

1. :func:`prestartup` (from ``custom_nodes/membackend/prestartup_script.py``, before
   torch): settings, machine facts without a GPU context, selection, and **one log
   line** saying which backend, why, and how to force another or switch off.

   * ``MEMBACKEND_DISABLE=1``, ComfyUI's ``--disable-dynamic-vram``, the ``aimdo``
     backend selected, or no accelerator backend fitting (the ``host`` fallback
     chosen automatically): nothing is patched; ComfyUI runs stock.
   * another backend: ComfyUI's arguments are set for it (aimdo's compiler and
     CUDA-graph paths need aimdo's own device contexts, so they are switched off;
     dynamic VRAM is switched on) and ``comfy_aimdo.control.init_devices`` is
     replaced by :meth:`Runtime.init_devices`.

   The decision is made here, not later on a thread: ComfyUI reads
   ``args.enable_dynamic_vram`` right after its torch import to decide whether to
   call ``init_devices`` at all, so the arguments must be right before torch. It
   stays cheap instead: settings come from
   :func:`membackend.settings.quick_settings` (no pydantic unless a value needs
   it), and the policy, the facade and the buffers are imported only when
   ``init_devices`` starts membackend (:mod:`.startup_cost` measures the cost).

2. :meth:`Runtime.init_devices` (when ComfyUI calls it): consumes the device
   generator, opens the session and the residency manager, installs the facade
   (:mod:`membackend.comfyui.vbar`) over ``comfy_aimdo.model_vbar`` and
   ``comfy_aimdo.torch.aimdo_to_tensor``, comfy-aimdo's ``VRAMBuffer``,
   ``HostBuffer`` and ``ModelMMAP`` (:mod:`membackend.comfyui.buffers`; each only
   where it exists), and wherever ComfyUI's modules bound those names, then the wiring (:mod:`membackend.comfyui.wiring`), and returns
   True. A second call (ComfyUI's ``TypeError`` retry) returns the first answer.

**Never in the way (G6).** Any exception in any step — or later, inside any
patched function — restores every original (:meth:`Runtime.abort`), logs one
line with the cause, and ComfyUI carries on stock: the original
``init_devices`` answers, the original function is called with the same
arguments. After ``init_devices`` said yes, ComfyUI has swapped in its dynamic
patcher and comfy-aimdo has no device, so aimdo's own VBAR functions could not
serve the patchers already made: an abort then restores every wiring patch and
ComfyUI's legacy patcher for new models, and leaves the facade names in place for
the existing ones (a failing fault answers "out of memory", so ComfyUI casts
those weights from its own copy and outputs stay right).
"""

from __future__ import annotations

import gc
import importlib
import itertools
import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .._version import __version__
from ..settings import quick_settings
from ..types import Device
from .patches import Patches

if TYPE_CHECKING:
    from ..manager import BackendManager, Selection
    from ..residency import ResidencyManager
    from . import vbar as facade
    from .streams import CopyFences

log = logging.getLogger("membackend")

__all__ = ["prestartup", "Runtime", "FACADE_NAMES", "current", "HOW_TO"]

FACADE_NAMES = ("ModelVBAR", "vbar_fault", "vbar_unpin", "vbar_signature_compare", "vbars_reset_watermark_limits",
                "vbars_analyze")
BUFFER_NAMES = (("comfy_aimdo.vram_buffer", "VRAMBuffer"), ("comfy_aimdo.host_buffer", "HostBuffer"),
                ("comfy_aimdo.model_mmap", "ModelMMAP"))
_BUFFERS = {n for _, n in BUFFER_NAMES}
HOW_TO = "force another with MEMBACKEND_BACKEND=<name>, switch membackend off with MEMBACKEND_DISABLE=1"

_current: "Runtime | None" = None


def current() -> "Runtime | None":
    """The adapter armed or running in this process (None: ComfyUI runs stock)."""
    return _current


def _say(text: str, level: int = logging.INFO) -> None:
    log.log(level, "membackend %s: %s", __version__, text)


def prestartup() -> "Runtime | None":
    """The prestartup script's work (see the module docstring); never raises."""
    global _current
    rt = None
    try:
        settings = quick_settings()
        if settings.disable:
            _say("off (MEMBACKEND_DISABLE is set); ComfyUI runs its stock memory engine; unset it to turn "
                 "membackend on")
            return None
        args = getattr(sys.modules.get("comfy.cli_args"), "args", None)
        if args is not None and getattr(args, "disable_dynamic_vram", False):
            _say("off (ComfyUI's --disable-dynamic-vram); ComfyUI runs stock")
            return None
        from ..drivers.open import machine_for
        from ..manager import BackendManager

        mgr = BackendManager(settings)
        machine = machine_for(settings)
        sel = mgr.select(machine)
        name = sel.record.name if sel.record else None
        others = ", ".join(n for n, c in sorted(sel.candidates.items()) if n != name and c.score > 0) or "none"
        if name == "aimdo":
            _say(f"backend aimdo ({sel.how}: {sel.reason}): ComfyUI's own comfy-aimdo runs untouched; "
                 f"others that fit: {others}; {HOW_TO}")
            return None
        if sel.how == "fallback":
            _say(f"no accelerator backend fits ({sel.reason}); ComfyUI runs stock; {HOW_TO}")
            return None
        rt = Runtime(mgr, machine, sel)
        rt.arm(args)
        _current = rt
        _say(f"backend {name} ({sel.how}: {sel.reason}); starts when ComfyUI initialises its devices; "
             f"others that fit: {others}; {HOW_TO}")
        return rt
    except Exception as exc:
        if rt is not None:
            rt.patches.restore()
        _current = None
        _say(f"not started ({type(exc).__name__}: {exc}); ComfyUI runs stock; {HOW_TO}", logging.WARNING)
        return None


class _ComfyRaised(Exception):
    """Carries an exception ComfyUI's own function raised through a guarded replacement."""

    def __init__(self, exc: Exception):
        super().__init__(str(exc))
        self.exc = exc


class Runtime:
    """The adapter in one process: selection, session, policy, facade objects and every patch."""

    def __init__(self, manager: BackendManager, machine: Any, selection: Selection):
        self.manager = manager
        self.machine = machine
        self.selection = selection
        self.name = selection.record.name
        self.patches = Patches()
        self.session: Any = None
        self.residency: ResidencyManager | None = None
        self.fences: CopyFences | None = None  # tokens for the cast path's queued copies (G2)
        self.vbars: "weakref.WeakSet[facade.ModelVBAR]" = weakref.WeakSet()
        self.pending: "weakref.WeakSet[facade.ModelVBAR]" = weakref.WeakSet()  # full unloads put off
        self.started: bool | None = None  # None: init_devices not called yet
        self.aborted: str | None = None
        self.unloads: list[dict[str, Any]] = []
        self.held: "dict[int, Any]" = {}  # id -> dynamic patcher held warm (G4), least recently used first
        self.run_ids: set[int] = set()
        self.ram_floor: int | None = None
        self.given_back = 0
        self.idles = 0  # times the prompt queue emptied
        self.idle_bytes = 0  # what on_idle gave back, in all
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._original_init: Callable[..., Any] | None = None
        kinds = tuple(getattr(selection.record.plugin, "device_kinds", ("cpu",)))
        self.kind = next((k for k in ("cuda", "hip") if k in kinds), "cpu")

    # ------------------------------------------------------------------ arming (prestartup)

    def arm(self, args: Any) -> None:
        if args is not None:
            # aimdo's compiler and CUDA-graph paths need aimdo's own device contexts
            for attr in ("disable_comfy_compiler", "disable_cuda_graphs", "enable_dynamic_vram"):
                self.patches.replace(args, attr, True, required=False)
        control = importlib.import_module("comfy_aimdo.control")
        self._original_init = control.init_devices
        self.patches.replace(control, "init_devices", self.init_devices)

    # ------------------------------------------------------------------ start (init_devices)

    def init_devices(self, device_ids: Any) -> bool:
        """Replaces ``comfy_aimdo.control.init_devices``: start membackend; on any failure, stock."""
        ids = list(device_ids)
        with self._lock:
            if self.started is not None:
                return self.started
            try:
                self.start(ids)
                self.started = True
                return True
            except Exception as exc:
                self.started = False
                original = self._original_init
                self.abort(exc, "starting")
                self._close_quietly()  # nothing reached ComfyUI yet: give back what start opened
                return original(ids) if original is not None else False

    def start(self, ids: list[Any]) -> None:
        from ..residency import ResidencyManager
        from . import vbar as facade
        from . import wiring
        from .streams import CopyFences

        self.session = self.manager.session(self.machine, selection=self.selection)
        self.residency = ResidencyManager(self.session)
        self.fences = CopyFences(self.residency)
        self.devices = [self.device_for(i[0] if isinstance(i, tuple) else i) for i in ids] or [self.device_for(0)]
        facade.set_runtime(self)
        self._install_facade()
        wiring.wire(self)
        _say(f"started on {self.name} for {', '.join(map(str, self.devices))}; patched: "
             f"{len(self.patches.applied)} name(s)"
             + (f"; not present in this ComfyUI: {', '.join(self.patches.skipped)}" if self.patches.skipped else ""))

    def _install_facade(self) -> None:
        from . import buffers
        from . import vbar as facade

        mv = importlib.import_module("comfy_aimdo.model_vbar")
        originals = {}
        for name in FACADE_NAMES:
            originals[name] = getattr(mv, name)
            self.patches.replace(mv, name, getattr(facade, name))
        ct = sys.modules.get("comfy_aimdo.torch")
        if ct is None:
            try:
                ct = importlib.import_module("comfy_aimdo.torch")
            except ImportError:
                ct = None
        if ct is not None and self.patches.replace(ct, "aimdo_to_tensor", facade.aimdo_to_tensor, required=False):
            originals["aimdo_to_tensor"] = self.patches.original(ct, "aimdo_to_tensor")
        # comfy-aimdo's cast buffer, host buffer and file map need its device: ours, where they exist
        for modname, name in BUFFER_NAMES:
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                self.patches.skipped.append(f"{modname}.{name}")
                continue
            if self.patches.replace(mod, name, getattr(buffers, name), required=False):
                originals[name] = self.patches.original(mod, name)
        # ComfyUI's modules that bound these names with ``from comfy_aimdo... import name``
        by_id = {id(v): k for k, v in originals.items()}
        for modname, mod in list(sys.modules.items()):
            if mod is None or not (modname == "comfy" or modname.startswith("comfy.") or modname == "execution"):
                continue
            for attr, value in list(vars(mod).items()):
                key = by_id.get(id(value))
                if key is not None and value is originals[key]:
                    self.patches.replace(mod, attr, getattr(buffers if key in _BUFFERS else facade, key))

    # ------------------------------------------------------------------ G6

    def guard(self, what: str, original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
        """``replacement`` with the same call; any exception in it aborts the adapter and calls ``original``.

        An exception raised by ComfyUI's own function called through :meth:`comfy` is ComfyUI's, not the
        adapter's: it propagates unchanged and nothing is switched off or called twice."""
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.aborted is not None:
                return original(*args, **kwargs)
            try:
                return replacement(*args, **kwargs)
            except _ComfyRaised as raised:
                raise raised.exc.with_traceback(raised.exc.__traceback__) from None
            except Exception as exc:
                self.abort(exc, what)
                return original(*args, **kwargs)
        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__name__ = getattr(original, "__name__", what)
        call.__doc__ = getattr(original, "__doc__", None)
        call._membackend = what  # type: ignore[attr-defined]
        return call

    @staticmethod
    def comfy(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ComfyUI's own ``fn`` from inside a guarded replacement (see :meth:`guard`)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _ComfyRaised(exc) from None

    def abort(self, exc: BaseException, where: str) -> None:
        """Restore every original and say so in one line; ComfyUI carries on stock."""
        global _current
        with self._lock:
            if self.aborted is not None:
                return
            self.aborted = f"{where}: {type(exc).__name__}: {exc}"
            keep = None
            if self.started:
                from . import buffers
                from . import vbar as facade

                # ComfyUI already swapped in its dynamic patcher on our word, and comfy-aimdo never initialised
                # a device: its own VBAR functions cannot serve those patchers. The facade stays for them (its
                # fault answers "out of memory" once it fails, so ComfyUI casts from its own copy); new patchers
                # go legacy below. Every other patch (the wiring) is restored.
                surface = {id(getattr(facade, n)) for n in (*FACADE_NAMES, "aimdo_to_tensor")}
                surface |= {id(getattr(buffers, n)) for n in _BUFFERS}

                def keep(obj: Any, name: str) -> bool:
                    return id(getattr(obj, name, None)) in surface
            failed = self.patches.restore(keep)
            self.held.clear()  # stock ComfyUI holds nothing warm
            if self.started:
                failed += self._legacy_patcher()
            note = f"; could not restore {', '.join(failed)}" if failed else ""
            what = ("every wiring patch restored, new models load with ComfyUI's legacy patcher" if self.started
                    else "every original restored")
            _say(f"switched off while {where} ({type(exc).__name__}: {exc}); {what}{note}; ComfyUI carries on stock",
                 logging.WARNING)
            if _current is self:
                _current = None

    @staticmethod
    def _legacy_patcher() -> list[str]:
        """ComfyUI swapped in its dynamic patcher because init_devices said yes: new models go legacy again
        (what ComfyUI itself does when init_devices fails). Models already loaded keep their facade VBARs,
        which stay usable: comfy-aimdo's own functions call their methods."""
        mp = sys.modules.get("comfy.model_patcher")
        try:
            if mp is not None and getattr(mp, "CoreModelPatcher", None) is getattr(mp, "ModelPatcherDynamic", ()):
                mp.CoreModelPatcher = mp.ModelPatcher
        except Exception as exc:
            return [f"comfy.model_patcher.CoreModelPatcher: {exc}"]
        return []

    # ------------------------------------------------------------------ used by the facade and the wiring

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def device_for(self, index: Any) -> Device:
        """The membackend device for a torch device index (or a torch.device); cpu-only backends: cpu:0."""
        idx = getattr(index, "index", index)
        idx = 0 if idx is None else int(idx)
        return Device("cpu", 0) if self.kind == "cpu" else Device(self.kind, idx)

    def page_size(self, device: Device) -> int:
        return int(getattr(self.selection.record.plugin, "page_size", 2 << 20))

    def before_fault(self, vbar: "facade.ModelVBAR") -> None:
        self.pending.discard(vbar)  # used again: its put-off unload is cancelled

    def unload_vbar(self, vbar: "facade.ModelVBAR", reason: str, earlier: int = 0) -> None:
        """Full unload of a VBAR's model (G1), now when nothing is pinned, else at the next quiescent point.

        ``earlier``: bytes ComfyUI's own detach already freed from it (for the log line)."""
        if any(state & 2 for state in self.residency.residency(vbar._model, vbar._dev)):
            self.pending.add(vbar)  # destroying pinned pages is what aborts aimdo (#14396): wait
            return
        self.pending.discard(vbar)
        r = vbar._model.reservation(vbar._dev)
        if r is None:
            return
        dropped = self.residency.full_unload(vbar._model) + earlier
        released = int(r.released)
        entry = {"model": vbar._model.id, "device": str(vbar._dev), "bytes": dropped, "reservations": released,
                 "reserved_bytes": r.size, "reason": reason}
        self.unloads.append(entry)
        _say(f"full unload of {vbar._model.id} on {vbar._dev}: {dropped} bytes freed, {released} reservation(s) "
             f"of {r.size} bytes returned ({reason})")

    def quiescent(self) -> None:
        """Between nodes: run the full unloads that waited for pins to go; give back held models under
        RAM pressure (G4)."""
        for vbar in list(self.pending):
            self.unload_vbar(vbar, "put off until no page was pinned")
        self.relieve_ram()

    def idle(self) -> int:
        """ComfyUI's prompt queue emptied (nothing queued, nothing running): the backend gives back what it
        keeps for reuse (``ResidencyManager.on_idle``); resident models stay resident (G4). Returns the bytes
        given back; one log line when there were any."""
        if self.residency is None or self.aborted is not None:
            return 0
        given = self.residency.on_idle()
        self.idles += 1
        self.idle_bytes += given
        if given:
            _say(f"prompt queue empty: gave back {given} bytes the backend kept for reuse")
        return given

    # ------------------------------------------------------------------ G4: held references, RAM pressure

    def hold(self, patchers: list[Any]) -> None:
        """Keep strong references to the dynamic patchers of this run (most recent last), so a workflow
        switch that drops ComfyUI's own references does not let the garbage collector destroy a model the
        budget could keep warm. They are the run's until the next call; :meth:`relieve_ram` gives back the
        others, least recently used first, while RAM is under pressure."""
        with self._lock:
            self.run_ids = {id(p) for p in patchers}
            for p in patchers:
                self.held.pop(id(p), None)
                self.held[id(p)] = p
        self.relieve_ram()

    def ram_pressure(self) -> bool:
        """True while the host's available RAM (psutil ``MemAvailable``, capped by a cgroup) is below
        ``ram_floor`` bytes (default: a tenth of the host's RAM)."""
        from ..hostmem import host_memory

        hm = host_memory()
        floor = self.ram_floor if self.ram_floor is not None else hm.total // 10
        return hm.available < floor

    def relieve_ram(self) -> int:
        """Under RAM pressure, drop held references -- least recently used first, never the current run's --
        until the pressure is gone or only the run's are left. Returns how many were given back."""
        given = 0
        with self._lock:
            while self.held and self.ram_pressure():
                victim = next((k for k in self.held if k not in self.run_ids), None)
                if victim is None:
                    break
                self.held.pop(victim)
                given += 1
                gc.collect()  # the model goes now if nothing else holds it: its reservation is returned
        if given:
            self.given_back += given
            _say(f"RAM pressure: gave back {given} held model(s), least recently used first")
        return given

    def close_vbar(self, vbar: "facade.ModelVBAR") -> None:
        self.pending.discard(vbar)
        self.vbars.discard(vbar)
        if self.fences is not None:
            self.fences.forget(vbar._model)
        if self.residency is not None and vbar._model in self.residency.models():
            self.residency.unregister(vbar._model)

    def status(self) -> dict[str, Any]:
        """What ``GET /membackend/status`` answers."""
        out: dict[str, Any] = {"version": __version__, "backend": self.name, "how": self.selection.how,
                               "reason": self.selection.reason, "started": bool(self.started),
                               "aborted": self.aborted, "patched": self.patches.applied,
                               "not_present": list(self.patches.skipped), "unloads": list(self.unloads),
                               "idle": {"times": self.idles, "bytes": self.idle_bytes}}
        if self.session is None:
            return out
        budgets = {}
        for d in getattr(self, "devices", []):
            b = self.session.budget_query(d)
            budgets[str(d)] = {"total": b.total, "free": b.free, "headroom": b.headroom, "usable": b.usable,
                               "source": b.source}
        out["budgets"] = budgets
        out["reservations"] = [{"id": r.id, "device": str(r.device), "size": r.size}
                               for r in self.session.reservations()]
        out["models"] = self.residency.stats()
        return out

    def _close_quietly(self) -> None:
        self._detach_facade()
        if self.session is not None:
            try:
                self.session.close()
            except Exception as exc:
                log.debug("membackend: closing the session after a failed start: %s", exc)

    def _detach_facade(self) -> None:
        facade = sys.modules.get(__package__ + ".vbar")  # not imported: the facade never ran
        if facade is not None and facade.get_runtime() is self:
            facade.set_runtime(None)

    def stop(self) -> None:
        """Undo everything (tests, or a host application shutting the adapter down)."""
        global _current
        self.patches.restore()
        self.held.clear()
        self._detach_facade()
        if _current is self:
            _current = None
        if self.session is not None:
            self.session.close()
