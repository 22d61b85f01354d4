"""The backend's optional members (``hookspec.OptionalMembers``), read once when the session is built.

:class:`Members` is the table: one row (a field) per member the session and the layers above it read, with its
type, its default (what a backend without it gets) and its contract check. A member that is missing, None, or
fails its check reads as its default (a failed check is logged once: the backend broke the contract). A new
optional member is one row here; callers read ``session.members.NAME`` instead of ``getattr(backend, ...)``.

The members the plugin manager reads before any session exists (``version``, ``settings``, ``from_settings``,
``platform``, ``platform_values``) are not rows, nor is ``driver`` (reading it opens the VMM backend's driver).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from ..types import Capabilities

log = logging.getLogger("membackend._session")


def _row(accepts: Callable[[Any], bool], accepted: str) -> dict[str, Any]:
    return {"accepts": accepts, "accepted": accepted}


def _kinds(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(isinstance(k, str) for k in v)


_CALLABLE = _row(callable, "a callable")


@dataclass(frozen=True)
class Members:
    """The backend's optional members as the session read them once (see the module docstring); each row's
    meaning is ``hookspec.OptionalMembers``'."""

    #: what the mechanism does and needs
    capabilities: Capabilities = field(default_factory=Capabilities,
                                       metadata=_row(lambda v: isinstance(v, Capabilities), "a Capabilities"))
    #: the device kinds the backend serves
    device_kinds: tuple[str, ...] = field(default=("cpu", "cuda", "hip"), metadata=_row(_kinds, "a tuple of kinds"))
    #: the page size mapped on every device, where it is one (``page_size_on`` wins)
    page_size: int = field(default=2 << 20, metadata=_row(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an int > 0"))
    #: ``page_size_on(device) -> int``
    page_size_on: Callable[..., int] | None = field(default=None, metadata=_CALLABLE)
    #: ``own_headroom(device, total) -> (bytes, source)``: level 4 of the headroom's precedence
    own_headroom: Callable[..., tuple[int, str]] | None = field(default=None, metadata=_CALLABLE)
    #: ``use_headroom(headroom_by_device, instead_of=None)``: the session's Headroom objects, handed down
    use_headroom: Callable[..., None] | None = field(default=None, metadata=_CALLABLE)
    #: ``follow_headroom(decide, instead_of=None)``: the older form of ``use_headroom`` (one release more)
    follow_headroom: Callable[..., None] | None = field(default=None, metadata=_CALLABLE)
    #: ``tensor_device(device) -> str``
    tensor_device: Callable[..., str] | None = field(default=None, metadata=_CALLABLE)
    #: ``room_split(device) -> RoomSplit``
    room_split: Callable[..., Any] | None = field(default=None, metadata=_CALLABLE)
    #: ``kept_windows(device) -> KeptWindows | None``
    kept_windows: Callable[..., Any] | None = field(default=None, metadata=_CALLABLE)
    #: ``descriptor_room(device) -> DescriptorRoom | None``
    descriptor_room: Callable[..., Any] | None = field(default=None, metadata=_CALLABLE)
    #: ``fence_token(reservation, stream) -> FenceToken``
    fence_token: Callable[..., Any] | None = field(default=None, metadata=_CALLABLE)
    #: ``host_unregister(address) -> bool``
    host_unregister: Callable[..., bool] | None = field(default=None, metadata=_CALLABLE)

    @classmethod
    def read(cls, backend: Any) -> "Members":
        """Each row read once from ``backend``: its value, or its default where it is missing, None or fails
        its check (logged)."""
        values: dict[str, Any] = {}
        for row in fields(cls):
            value = getattr(backend, row.name, None)
            if value is None:
                continue
            if row.name == "device_kinds" and _kinds(value):
                value = tuple(value)
            if not row.metadata["accepts"](value):
                log.warning("membackend: backend %r's %s is %r, not %s (hookspec.OptionalMembers); the default "
                            "applies", getattr(backend, "name", "?"), row.name, value, row.metadata["accepted"])
                continue
            values[row.name] = value
        return cls(**values)

    @property
    def headroom_follower(self) -> bool:
        """Whether the backend takes the headroom the session decides (``use_headroom`` or ``follow_headroom``,
        each read only together with ``own_headroom``): its budget then reports the headroom in force."""
        return self.own_headroom is not None and (self.use_headroom is not None or self.follow_headroom is not None)
