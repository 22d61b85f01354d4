"""The one shape every GPU driver wrapper has (CUDA, HIP, and the simulations of both).

A wrapper takes the driver module as a parameter (``cuda.bindings.driver``,
``hip.hip`` or a simulated module with the same names), calls exactly what the
VMM backend needs, and turns every non-success code into
:class:`~membackend.types.DriverError` with the code and the call's name. A
module that cannot even be called (cuda-python with no driver installed
raises instead of returning a code) gives ``DriverError("unavailable", ...)``.
"""

from __future__ import annotations

from typing import Any

from ..types import DriverError

__all__ = ["GpuDriver", "EventToken"]


class GpuDriver:
    """Base of :class:`~membackend.drivers.cuda.CudaDriver` and :class:`~membackend.drivers.hip.HipDriver`.

    Subclasses set ``vendor`` and the vendor's codes (``SUCCESS``, ``OOM``,
    ``NOT_READY``) and implement the methods below with their own API names.
    ``sim`` is the :class:`~membackend.drivers.sim.SimPlatform` behind a
    simulated module, else None.
    """

    vendor = ""
    SUCCESS: Any = 0
    OOM: Any = 2
    NOT_READY: Any = 600

    def __init__(self, module: Any, label: str):
        self.m = module
        self.label = label
        self.sim = getattr(module, "platform", None)

    def call(self, name: str, *args: Any) -> tuple:
        """Call ``name`` and return the values after the status code; raise on failure."""
        try:
            result = getattr(self.m, name)(*args)
        except Exception as exc:  # no driver library, bad argument types: the call never ran
            raise DriverError("unavailable", name, f"{type(exc).__name__}: {exc}") from exc
        status = result[0] if isinstance(result, tuple) else result
        if status != self.SUCCESS:
            raise DriverError(status, name)
        return result[1:] if isinstance(result, tuple) else ()

    def is_oom(self, exc: DriverError) -> bool:
        return exc.code == self.OOM

    # the interface; each returns plain Python ints where it returns anything
    def init(self) -> None: raise NotImplementedError
    def device_count(self) -> int: raise NotImplementedError
    def set_device(self, index: int) -> None: raise NotImplementedError
    def current_device(self) -> int: raise NotImplementedError
    def total_mem(self, index: int) -> int: raise NotImplementedError
    def name(self, index: int) -> str: raise NotImplementedError
    def integrated(self, index: int) -> bool: raise NotImplementedError
    def arch(self, index: int) -> str: raise NotImplementedError
    def driver_model(self, index: int) -> str | None: raise NotImplementedError
    def granularity(self, index: int) -> int: raise NotImplementedError
    def address_reserve(self, size: int, alignment: int) -> int: raise NotImplementedError
    def address_free(self, ptr: int, size: int) -> None: raise NotImplementedError
    def create(self, size: int, index: int) -> Any: raise NotImplementedError
    def release(self, handle: Any) -> None: raise NotImplementedError
    def map(self, ptr: int, size: int, handle: Any) -> None: raise NotImplementedError
    def unmap(self, ptr: int, size: int) -> None: raise NotImplementedError
    def set_access(self, ptr: int, size: int, index: int) -> None: raise NotImplementedError
    def mem_get_info(self) -> tuple[int, int]: raise NotImplementedError
    def event_create(self) -> Any: raise NotImplementedError
    def event_record(self, event: Any, stream: Any) -> None: raise NotImplementedError
    def event_query(self, event: Any) -> bool: raise NotImplementedError
    def event_synchronize(self, event: Any) -> None: raise NotImplementedError
    def event_destroy(self, event: Any) -> None: raise NotImplementedError
    def stream_create(self) -> Any: raise NotImplementedError
    def stream_synchronize(self, stream: Any) -> None: raise NotImplementedError
    def device_synchronize(self) -> None: raise NotImplementedError
    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Any) -> None: raise NotImplementedError

    def _query(self, name: str, event: Any) -> bool:
        """Event queries answer "not ready" with a status code that is no failure."""
        try:
            self.call(name, event)
        except DriverError as exc:
            if exc.code == self.NOT_READY:
                return False
            raise
        return True


class EventToken:
    """A fence token (``done()``/``wait()``) over an event recorded on a stream; destroys it once waited."""

    __slots__ = ("driver", "event", "device", "_done")

    def __init__(self, driver: GpuDriver, event: Any, device: int):
        self.driver, self.event, self.device, self._done = driver, event, device, False

    def done(self) -> bool:
        if not self._done and self.driver.event_query(self.event):
            self._finish()
        return self._done

    def wait(self) -> None:
        if not self._done:
            self.driver.event_synchronize(self.event)
            self._finish()

    def _finish(self) -> None:
        self._done = True
        self.driver.event_destroy(self.event)

    def __repr__(self) -> str:
        return f"EventToken(device={self.device}, done={self._done})"
