"""What the simulated CUDA and HIP modules share: status codes and the call convention.

Both vendors' Python bindings return a tuple whose first item is the status
(``CUresult`` / ``hipError_t``) followed by the outputs, which are ``None``
when the call failed. Fault injection is checked before the call runs.

Every call holds the platform's lock from the injection check to the result,
so calls from several threads are each one step, as a real driver's are
(the CUDA and HIP driver APIs are thread-safe).
"""

from __future__ import annotations

from typing import Any, Callable

from ...types import SIM_SOURCE
from ..gpu import host_address
from .platform import SimError, SimPlatform

__all__ = ["SimApi", "host_address"]


class SimApi:
    """Base of the simulated modules: ``platform`` is the state, ``types`` the real bindings module."""

    types: Any = None
    kinds: dict[str, str] = {}  # SimError kind -> the vendor's status name
    success: str = ""
    status_enum: str = ""

    def __init__(self, platform: SimPlatform):
        self.platform = platform
        self.label = f"{SIM_SOURCE}{platform.profile.name}"
        self._status = getattr(self.types, self.status_enum)

    def __getattr__(self, name: str) -> Any:
        """Types, enums and constants come from the real bindings; their functions never do."""
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self.types, name)
        if callable(value) and not isinstance(value, type):
            raise AttributeError(f"the simulated driver has no {name}")
        return value

    def _run(self, name: str, outputs: int, fn: Callable[[], Any]) -> tuple:
        try:
            with self.platform.lock:
                self.platform.inject(name)
                result = fn()
        except SimError as exc:
            code = exc.code if exc.kind == "injected" else getattr(self._status, self.kinds[exc.kind])
            return (self._status(int(code)),) + (None,) * outputs
        if outputs == 0:
            values: tuple = ()
        elif outputs == 1:
            values = (result,)
        else:
            values = tuple(result)
        return (getattr(self._status, self.success),) + values
