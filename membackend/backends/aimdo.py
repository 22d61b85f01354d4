"""comfy-aimdo as a backend: today's stock engine, selectable by name, the baseline of every comparison.

Each reservation is one ``comfy_aimdo.model_vbar.ModelVBAR`` (32 MiB pages).
A fault calls ``ModelVBAR.fault`` and unpins at once, as ComfyUI does after
the op; generations are aimdo's page signatures. What aimdo cannot do is
stated, not hidden (reference/aimdo-internals.md):

* it frees only from a watermark up, so a free of a range that does not reach
  the end of the reservation drops nothing and logs why;
* it evicts pages on its own under pressure, so resident bytes here are
  aimdo's ``loaded_size`` deltas, not a guarantee;
* it has no fence of its own: a device-wide fence synchronizes through torch
  when torch is loaded.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .. import __version__
from ..hookspec import hookimpl
from ..types import Budget, Candidate, Capabilities, Device, DriverError, Fault, Machine, Reservation, WrongDevice

log = logging.getLogger(__name__)

__all__ = ["AimdoBackend"]

VBAR_PAGE_SIZE = 32 << 20  # comfy-aimdo src: VBAR_PAGE_SIZE
DEFAULT_HEADROOM = 256 << 20  # comfy-aimdo src: VRAM_HEADROOM


class _Capture(logging.Handler):
    """Collects what comfy-aimdo logs while it initialises: its own reason when it cannot."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class AimdoBackend:
    name = "aimdo"
    version = __version__
    # the stock engine keeps nothing warm by budget and keeps reservations until GC (DESIGN.md)
    capabilities = Capabilities(release_on_full_unload=False, fence_granularity="device")
    device_kinds = ("cuda", "hip")

    def __init__(self, control: Any = None, model_vbar: Any = None):
        self._control, self._model_vbar = control, model_vbar
        self._ready: dict[int, str | None] = {}  # device -> None if initialised, else aimdo's reason

    @classmethod
    def from_settings(cls, settings: Any) -> "AimdoBackend":
        return cls()

    def _modules(self) -> tuple[Any, Any]:
        if self._control is None:
            from comfy_aimdo import control, model_vbar  # the `aimdo` extra

            self._control, self._model_vbar = control, model_vbar
        return self._control, self._model_vbar

    def _init(self, index: int) -> str | None:
        """Initialise aimdo for device ``index`` once; None on success, else aimdo's reason."""
        if index in self._ready:
            return self._ready[index]
        try:
            control, _ = self._modules()
        except ImportError as exc:
            return f"comfy-aimdo is not installed ({exc}); install membackend[aimdo]"
        # aimdo logs through the root logger; hold its lines for the doctor instead of the console
        capture, root = _Capture(), logging.getLogger()
        old_level, old_handlers = root.level, root.handlers[:]
        root.handlers = [capture]
        root.setLevel(logging.INFO)
        try:
            ok = control.lib is not None or control.init()
            ok = ok and (index in [getattr(d, "device", None) for d in control.devctxs] or control.init_device(index))
        except Exception as exc:
            ok, capture.lines = False, capture.lines + [f"{type(exc).__name__}: {exc}"]
        finally:
            root.handlers = old_handlers
            root.setLevel(old_level)
        reason = None if ok else ("; ".join(capture.lines) or f"comfy_aimdo.control.init_device({index}) returned False")
        self._ready[index] = reason
        return reason

    def _index(self, device: Device) -> int:
        if device.kind not in self.device_kinds:
            raise WrongDevice(f"comfy-aimdo serves GPUs, not {device}")
        reason = self._init(device.index)
        if reason is not None:
            raise DriverError("unavailable", "comfy_aimdo.control.init_device", reason)
        return device.index

    # ------------------------------------------------------------------ contract

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        reason = self._init(0)
        if reason is not None:
            return Candidate(self.name, 0, f"comfy-aimdo cannot initialise a device: {reason}")
        return Candidate(self.name, 5, "comfy-aimdo initialised device 0 (the stock engine)")

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        index = self._index(device)
        rounded = -(-size // VBAR_PAGE_SIZE) * VBAR_PAGE_SIZE
        try:
            vbar = self._model_vbar.ModelVBAR(rounded, index)
        except MemoryError as exc:
            raise DriverError("out of address space", "vbar_allocate", str(exc)) from exc
        return Reservation(device, int(vbar.base_addr), rounded, VBAR_PAGE_SIZE, self.name, handle=vbar, requested=size)

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        vbar = reservation.handle
        first = offset // VBAR_PAGE_SIZE
        pages = (offset + size - 1) // VBAR_PAGE_SIZE + 1 - first
        before = vbar.loaded_size()
        try:
            signature = vbar.fault(reservation.base + offset, size)
        except RuntimeError as exc:  # "Fault failed: 2"
            raise DriverError(str(exc).rsplit(" ", 1)[-1], "vbar_fault", str(exc)) from exc
        if signature is None:
            return Fault(False, (), first, 0)
        vbar.unpin(reservation.base + offset, size)  # ComfyUI unpins once the op is done
        return Fault(True, tuple(signature[:pages]), first, max(0, vbar.loaded_size() - before))

    @hookimpl
    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int:
        vbar = reservation.handle
        if offset + size < reservation.size:
            log.warning("membackend: comfy-aimdo frees only from a watermark up; [%d, %d) of %d bytes stays",
                        offset, offset + size, reservation.size)
            return 0
        before = vbar.loaded_size()
        vbar.set_watermark(offset)  # drops every page above
        vbar.set_watermark(reservation.size)  # faults above must not fail fast afterwards
        return max(0, before - vbar.loaded_size())

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        vbar = reservation.handle
        dropped = vbar.loaded_size()
        vbar.close()
        return dropped

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize(device.index)

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        index = self._index(device)
        torch = sys.modules.get("torch")
        if torch is not None:
            free, total = torch.cuda.mem_get_info(index)
            return Budget.of(int(total), int(free), DEFAULT_HEADROOM, "torch.cuda.mem_get_info (aimdo)")
        from ..drivers.cuda import CudaDriver

        driver = CudaDriver()
        driver.set_device(index)
        free, total = driver.mem_get_info()
        return Budget.of(total, free, DEFAULT_HEADROOM, "cuMemGetInfo (aimdo)")
