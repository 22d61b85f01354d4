"""comfy-aimdo as a backend: today's stock engine, selectable by name, the baseline of every comparison.

Each reservation is one ``comfy_aimdo.model_vbar.ModelVBAR`` (32 MiB pages).
A fault calls ``ModelVBAR.fault`` and unpins at once, as ComfyUI does after
the op; generations are aimdo's page signatures. Works with comfy-aimdo 0.5.5
(what ComfyUI pins) and 0.6.0.

What aimdo cannot do is stated, not hidden:

* its free paths (lowering a watermark, ``vbar_free``, pressure eviction)
  synchronise the **whole device** (``cuCtxSynchronize`` /
  ``hipDeviceSynchronize`` on the calling thread's current context): a free
  waits for every kernel and copy on the device, not only those touching the
  range; hence ``fence_granularity="device"``;
* it frees only from a watermark up, so a free of a range that does not reach
  the end of the reservation drops nothing and logs why;
* it evicts pages on its own under pressure, so resident bytes here are
  aimdo's ``loaded_size`` deltas, not a guarantee;
* it has no fence of its own: a device-wide fence synchronises through torch
  when torch has initialised the device;
* it initialises its devices once, all together: when the host application
  (ComfyUI) has already done so, the backend uses those devices
  (``control.get_devctx``); otherwise it initialises the first device it is
  used on, and aimdo refuses any other device afterwards (the verbs say so).

Initialisation happens on the first verb, never in the probe; a failing
initialisation is a :class:`~membackend.types.DriverError` from the verbs that
carries aimdo's own log lines as the reason.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import types
import weakref
from typing import Any, Callable

from .._version import __version__
from .._drivers.open import open_gpu_driver
from ..hookspec import hookimpl
from ..types import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverError,
    Fault,
    Machine,
    Reservation,
    WrongDevice,
    format_size,
)

log = logging.getLogger(__name__)

__all__ = ["AimdoBackend"]

VBAR_PAGE_SIZE = 32 << 20  # comfy-aimdo src: VBAR_PAGE_SIZE
DEFAULT_HEADROOM = 256 << 20  # comfy-aimdo src: VRAM_HEADROOM (its budget never keeps less)
SCORE = 10  # the generic GPU band of types.Score, below the generic vmm
SUPPORTED_OS = ("linux", "windows")  # aimdo ships .so and .dll only
_IMPLEMENTATION = {"cuda": "cuda", "hip": "rocm"}  # device kind -> control.init(implementation)


class _Capture(logging.Handler):
    """Collects what comfy-aimdo logs while it initialises: its own reason when it cannot."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _importer(name: str) -> Callable[[], Any]:
    return lambda: importlib.import_module(name)


def _loader(given: Any, default: str) -> Callable[[], Any]:
    """A module (or any non-callable namespace) is used as is; a callable is a loader called when needed."""
    if given is None:
        return _importer(default)
    if isinstance(given, types.ModuleType) or not callable(given):
        return lambda: given
    return given


class AimdoBackend:
    """The comfy-aimdo backend.

    ``control`` and ``model_vbar`` are the ``comfy_aimdo`` modules of those
    names, or zero-argument callables that import them; by default the real
    ones are imported when first needed. ``model_vbar`` binds ``control.lib``
    when it is imported, so it is loaded only after ``control.init()`` has
    loaded the library, and reloaded if it was imported before that.
    """

    name = "aimdo"
    version = __version__
    # the stock engine keeps nothing warm by budget and keeps reservations until GC
    capabilities = Capabilities(release_on_full_unload=False, fence_granularity="device")
    device_kinds = ("cuda", "hip")

    def __init__(self, control: Any = None, model_vbar: Any = None):
        self._load_control = _loader(control, "comfy_aimdo.control")
        self._load_model_vbar = _loader(model_vbar, "comfy_aimdo.model_vbar")
        self._control: Any = None
        self._model_vbar: Any = None
        # device index -> None once usable, else (aimdo call that failed, aimdo's reason)
        self._ready: dict[int, tuple[str, str] | None] = {}
        self._drivers: dict[str, Any] = {}  # device kind -> driver wrapper, for budgets without torch
        self._lock = threading.Lock()  # one initialisation at a time; verbs come from several threads
        #: device kind -> the indices the machine has, from the probe: aimdo's devices are set in one call
        self._indices: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_settings(cls, settings: Any) -> "AimdoBackend":
        return cls()

    # ------------------------------------------------------------------ initialisation

    def _control_module(self) -> Any:
        """``comfy_aimdo.control`` (importing it loads nothing native and touches no device)."""
        if self._control is None:
            self._control = self._load_control()
        return self._control

    def _bound_model_vbar(self, control: Any) -> Any:
        """``comfy_aimdo.model_vbar`` bound to the loaded library; call only once ``control.lib`` is set."""
        module = self._model_vbar or self._load_model_vbar()
        if getattr(module, "lib", None) is not control.lib:
            # imported before control.init() (or before a re-init): its ``lib`` is stale and every
            # ModelVBAR call would fail; re-running the module binds the library that is loaded now
            if getattr(module, "__spec__", None) is None:
                raise RuntimeError("comfy_aimdo.model_vbar was imported before comfy_aimdo.control.init() "
                                   "and cannot be reloaded; initialise comfy-aimdo before importing it")
            module = importlib.reload(module)
        self._model_vbar = module
        return module

    def _init(self, index: int, kind: str = "cuda") -> str | None:
        """Make aimdo usable on device ``index`` once; None on success, else the reason it is not."""
        failure = self._prepare(index, kind)
        return None if failure is None else failure[1]

    def _prepare(self, index: int, kind: str) -> tuple[str, str] | None:
        with self._lock:
            if index in self._ready:
                return self._ready[index]
            failure = self._initialise(index, kind)
            self._ready[index] = failure
            return failure

    def _initialise(self, index: int, kind: str) -> tuple[str, str] | None:
        try:
            control = self._control_module()
        except ImportError as exc:
            return "import comfy_aimdo.control", f"comfy-aimdo is not installed ({exc}); install membackend[aimdo]"
        # aimdo logs through the root logger; hold its lines for the error instead of the console
        capture, root = _Capture(), logging.getLogger()
        old_level, old_handlers = root.level, root.handlers[:]
        root.handlers = [capture]
        root.setLevel(logging.INFO)
        call = "comfy_aimdo.control.init"
        try:
            # init() again after the host application's would reset its settings (nvml pressure)
            ok = control.lib is not None or control.init(_IMPLEMENTATION.get(kind, "cuda"))
            if ok and not self._device_ready(control, index):
                call = "comfy_aimdo.control.init_devices"
                if getattr(control, "devctxs", None):  # set already (by ComfyUI, or for another device set)
                    capture.lines.append(f"comfy-aimdo's devices are initialised already and device {index} is "
                                         "not one of them; comfy-aimdo 0.6 initialises its devices once")
                    ok = False
                else:  # every device of the machine in one call: 0.6.0 refuses a second init_devices
                    wanted = sorted(set(self._indices.get(kind, ())) | {index})
                    ok = bool(control.init_devices(wanted))  # the others find their context on first use
            if ok:
                call = "comfy_aimdo.model_vbar"
                self._bound_model_vbar(control)
        except Exception as exc:  # aimdo raises plain exceptions (ValueError, RuntimeError, OSError)
            ok, capture.lines = False, capture.lines + [f"{type(exc).__name__}: {exc}"]
        finally:
            root.handlers = old_handlers
            root.setLevel(old_level)
        if ok:
            return None
        return call, "; ".join(capture.lines) or f"{call}({index}) returned False"

    @staticmethod
    def _device_ready(control: Any, index: int) -> bool:
        """Whether aimdo already has a context for ``index`` (``control.devctxs`` holds bare pointers)."""
        try:
            return bool(control.get_devctx(index))
        except RuntimeError:  # "comfy-aimdo device N is not initialized"
            return False

    def _index(self, device: Device) -> int:
        if device.kind not in self.device_kinds:
            raise WrongDevice(f"comfy-aimdo serves {' and '.join(self.device_kinds)} devices, not {device}")
        failure = self._prepare(device.index, device.kind)
        if failure is not None:
            raise DriverError("unavailable", *failure)
        return device.index

    # ------------------------------------------------------------------ contract

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        """Detect, never initialise: the package imports, the OS is one aimdo ships for, and a GPU is present."""
        try:
            control = self._control_module()
        except ImportError as exc:
            return Candidate(self.name, 0, f"comfy-aimdo is not installed ({exc}); install membackend[aimdo]")
        if machine.os not in SUPPORTED_OS:
            return Candidate(self.name, 0, f"comfy-aimdo runs on {' and '.join(SUPPORTED_OS)}, not {machine.os}")
        gpus = [d for d in machine.gpus() if d.device.kind in self.device_kinds]
        with self._lock:
            for kind in self.device_kinds:
                self._indices[kind] = tuple(sorted(d.device.index for d in gpus if d.device.kind == kind))
        if not gpus:
            return Candidate(self.name, 0, "no CUDA or HIP GPU was detected for comfy-aimdo to manage")
        lacking = [d for d in gpus if d.vmm_supported is False]  # aimdo's VBARs are cuMemCreate/hipMemCreate
        if lacking:
            return Candidate(self.name, 0, f"{lacking[0].device} ({lacking[0].name or 'unnamed'}) does not support "
                                           "virtual memory management, which comfy-aimdo's VBARs need")
        simulated = [d for d in gpus if d.simulated]  # listed by a simulated driver (sim:<profile>)
        if simulated:
            return Candidate(self.name, 0, f"{simulated[0].device} is simulated ({simulated[0].source}), and comfy-aimdo "
                                           "drives the real CUDA or HIP driver, which does not know it")
        state = "already loaded" if getattr(control, "lib", None) is not None else "initialised on first use"
        return Candidate(self.name, SCORE, f"comfy-aimdo on {gpus[0].device} ({state}; the stock engine)")

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        index = self._index(device)
        rounded = -(-size // VBAR_PAGE_SIZE) * VBAR_PAGE_SIZE
        try:
            vbar = self._model_vbar.ModelVBAR(rounded, index)
        except MemoryError as exc:  # "VBAR allocation failed"
            raise DriverError("out of address space", "vbar_allocate", str(exc)) from exc
        except Exception as exc:  # get_devctx's RuntimeError, ctypes errors
            raise DriverError("failed", "vbar_allocate", f"{type(exc).__name__}: {exc}") from exc
        try:
            base = int(vbar.base_addr)
            # aimdo clamps a VBAR to the card's capacity: a smaller range would break the contract
            pages = int(vbar.get_nr_pages()) if hasattr(vbar, "get_nr_pages") else rounded // VBAR_PAGE_SIZE
            if pages * VBAR_PAGE_SIZE < rounded:
                raise DriverError("out of address space", "vbar_allocate",
                                  f"comfy-aimdo clamped {rounded} bytes to {pages} pages of {VBAR_PAGE_SIZE}")
        except Exception as exc:
            box = [vbar]
            del vbar
            self._destroy(box)  # nothing stays reserved
            if isinstance(exc, DriverError):
                raise
            raise DriverError("failed", "vbar_get", f"{type(exc).__name__}: {exc}") from exc
        return Reservation(device, base, rounded, VBAR_PAGE_SIZE, self.name, handle=vbar, requested=size)

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        vbar = reservation.handle
        first = offset // VBAR_PAGE_SIZE
        pages = (offset + size - 1) // VBAR_PAGE_SIZE + 1 - first
        try:
            before = vbar.loaded_size()
            signature = vbar.fault(reservation.base + offset, size)
        except RuntimeError as exc:  # "Fault failed: 2"
            raise DriverError(str(exc).rsplit(" ", 1)[-1], "vbar_fault", str(exc)) from exc
        if signature is None:
            return Fault(False, (), first, 0)
        try:
            vbar.unpin(reservation.base + offset, size)  # ComfyUI unpins once the op is done
        except RuntimeError as exc:  # 0.6.0: "VBAR unpin failed"
            raise DriverError("failed", "vbar_unpin", str(exc)) from exc
        return Fault(True, tuple(signature[:pages]), first, max(0, vbar.loaded_size() - before))

    @hookimpl
    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int:
        vbar = reservation.handle
        if offset + size < reservation.size:
            log.warning("membackend: comfy-aimdo frees only from a watermark up; [%d, %d) of %d bytes stays",
                        offset, offset + size, reservation.size)
            return 0
        try:
            before = vbar.loaded_size()
            vbar.set_watermark(offset)  # drops every page above (synchronises the device first)
            vbar.set_watermark(reservation.size)  # faults above must not fail fast afterwards
        except RuntimeError as exc:  # 0.6.0: "VBAR set_watermark failed"
            raise DriverError("failed", "vbar_set_watermark", str(exc)) from exc
        return max(0, before - vbar.loaded_size())

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        box = [reservation.handle]
        try:
            dropped = int(box[0].loaded_size())
        except Exception:  # the range goes back regardless; the count is only for the ledger
            dropped = 0
        reservation.handle = None  # the reservation must not keep the VBAR alive (0.5.5 frees on the last reference)
        try:
            self._destroy(box)
        except DriverError:
            if box:  # not freed: keep it reachable so a retry can free it
                reservation.handle = box[0]
            raise
        return dropped

    @staticmethod
    def _destroy(box: list) -> None:
        """Free the VBAR in ``box`` now: ``close()`` from 0.6.0; on 0.5.5, drop the last reference.

        0.5.5 frees a VBAR only in ``__del__``. ``box`` holds the backend's
        only reference, so clearing it frees the VBAR at once; if someone else
        still holds one, the finaliser is run now (aimdo's frees once: it
        clears ``_ptr``), so the range never waits for the garbage collector.
        On failure the VBAR stays in ``box``.
        """
        close = getattr(box[0], "close", None)
        try:
            if callable(close):
                close()
                box.clear()
                return
            try:
                ref: Any = weakref.ref(box[0])
            except TypeError:
                ref = None
            box.clear()
            survivor = ref() if ref is not None else None
            if survivor is not None:
                survivor.__del__()
        except Exception as exc:
            raise DriverError("failed", "vbar_free", f"{type(exc).__name__}: {exc}") from exc

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize(device.index)
        except Exception as exc:
            raise DriverError("failed", "torch.cuda.synchronize", f"{type(exc).__name__}: {exc}") from exc

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        index = self._index(device)
        headroom = self._headroom()
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info(index)
                return Budget.of(int(total), int(free), headroom, "torch.cuda.mem_get_info (aimdo)")
        except Exception as exc:
            raise DriverError("failed", "torch.cuda.mem_get_info", f"{type(exc).__name__}: {exc}") from exc
        total, free, source = self._driver(device.kind).budget("device", index)
        return Budget.of(total, free, headroom, f"{source} (aimdo)")

    def _driver(self, kind: str) -> Any:
        """The real driver of ``kind`` (aimdo drives real GPUs only), opened and initialised once."""
        with self._lock:
            driver = self._drivers.get(kind)
            if driver is None:
                try:
                    driver = open_gpu_driver(kind)
                except Exception as exc:  # the vendor's Python bindings are not installed
                    raise DriverError("unavailable", "budget_query", f"{type(exc).__name__}: {exc}") from exc
                driver.init()
                self._drivers[kind] = driver
            return driver

    def own_headroom(self, device: Device, total: int) -> tuple[int, str]:
        """What comfy-aimdo keeps free (the lowest level of ``Session.headroom_in_force``)."""
        return self._headroom(), (f"backend {self.name}'s own rule (comfy-aimdo's: the larger of its "
                                  f"{format_size(DEFAULT_HEADROOM)} floor and its simple headroom)")

    def _headroom(self) -> int:
        """aimdo keeps the larger of its compile-time floor and the process-wide simple headroom free."""
        try:
            return max(DEFAULT_HEADROOM, int(self._control_module().get_simple_vram_headroom()))
        except Exception:  # an older aimdo, or not loaded: the floor still holds
            return DEFAULT_HEADROOM
