"""What the backend may add, as the session offers it: its optional members (:class:`~.members.Members`, read
once) and its optional hooks (``trim``, ``inspect``), each answer checked and every error typed."""

from __future__ import annotations

from typing import Any, Callable

from ..types import Device, DriverState, MembackendError, PartialFailure, PluginError
from .members import Members


class Optional:
    """The optional members and hooks of backend ``name``: ``members`` (read once), ``trim`` and ``inspect`` (the
    bound hooks, None where the backend has none), ``device`` (a served device), ``call(verb, fn, *args)``
    (the typed-error wrapper) and ``served()`` (every device the session reserved on)."""

    def __init__(self, name: str, members: Members, trim: Callable[..., Any] | None,
                 inspect: Callable[..., Any] | None, device: Callable[[Any], Device],
                 call: Callable[..., Any], served: Callable[[], list[Device]]):
        self._name, self._members, self._trim, self._inspect = name, members, trim, inspect
        self._device, self._call, self._served = device, call, served

    def page_size(self, device: Any) -> int:
        """``Session.page_size``: ``page_size_on(device)``, else the backend's one ``page_size``."""
        d = self._device(device)
        per_device = self._members.page_size_on
        if per_device is None:
            return self._members.page_size
        return int(self._call("page_size_on", per_device, d))

    def tensor_device(self, device: Any) -> str:
        """``Session.tensor_device``: the backend's answer, checked, else ``cpu`` / ``cuda:N``."""
        d = self._device(device)
        fn = self._members.tensor_device
        if fn is None:
            return "cpu" if d.kind == "cpu" else f"cuda:{d.index}"
        where = self._call("tensor_device", fn, d)
        if not isinstance(where, str) or not where or where.split(":")[0] not in ("cpu", "cuda"):
            raise PluginError(f"backend {self._name!r} broke the contract: tensor_device({d}) returned "
                              f"{where!r}; accepted: 'cpu' or 'cuda:N'")
        return where

    def host_unregister(self, address: int) -> bool:
        """``Session.host_unregister``: the backend's answer, else False."""
        fn = self._members.host_unregister
        if fn is None:
            return False
        return bool(self._call("host_unregister", lambda: fn(int(address))))

    def room_split(self, device: Any) -> Any:
        """``Session.room_split``: the backend's split, else None."""
        device = self._device(device)
        split = self._members.room_split
        return split(device) if split is not None else None

    def trim(self, device: Any = None) -> int:
        """``Session.trim``: on ``device`` or every device served, carrying on past failures (then one
        ``PartialFailure``); each answer a byte count >= 0."""
        devices = [self._device(device)] if device is not None else self._served()
        fn = self._trim
        if fn is None:
            return 0
        total, failures = 0, []
        for d in devices:
            try:
                n = self._call("trim", fn, device=d)
                if n.__class__ is bool or not isinstance(n, int) or n < 0:
                    raise PluginError(f"backend {self._name!r} broke the contract: trim({d}) returned {n!r}, "
                                      f"not a byte count >= 0")
                total += n
            except MembackendError as exc:
                if device is not None:
                    raise
                failures.append((f"trim({d})", exc))
        if failures:
            raise PartialFailure("trim", failures)
        return total

    def inspect(self, device: Any) -> DriverState | None:
        """``Session.inspect``: the driver's own view, checked; None without the hook."""
        device = self._device(device)
        fn = self._inspect
        if fn is None:
            return None
        state = self._call("inspect", fn, device=device)
        if state is not None and not isinstance(state, DriverState):
            raise PluginError(f"backend {self._name!r} broke the contract: inspect({device}) returned {state!r}")
        return state
