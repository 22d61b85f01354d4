"""The session's side of the headroom: one :class:`~membackend.platform.Headroom` per device, checked changes,
the budgets that carry it, and the hand-down to a backend that takes decisions on the headroom itself.

The precedence is computed by ``Headroom.in_force`` only. A backend with ``use_headroom`` (and
``own_headroom``) is handed the session's :class:`~membackend.platform.HeadroomByDevice` when the session is
built (:func:`hand_down`): its budget then reports the headroom in force, and a budget query crosses the
session-backend line once, downward, computing the precedence once. A backend without one gets the headroom
applied to its budget here, once per query.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..platform import HEADROOM_LIVE, Headroom, HeadroomByDevice
from ..types import Budget, ConfigError, Device, InvalidSize
from .checks import as_int
from .members import Members

_followed: dict[int, HeadroomByDevice] = {}  # id(backend) -> the session's table it follows now
_followed_lock = threading.Lock()


def hand_down(backend: Any, members: Members, by_device: HeadroomByDevice) -> Callable[[], None]:
    """Hand ``by_device`` to ``backend`` (``members.use_headroom``; for one release more a ``follow_headroom``
    is handed a function reading it); returns what takes it back (``Session.close``). The latest session built
    on a backend is the one followed; ``by_device.followed`` says whether this one is (its budgets are then
    trusted to carry its headroom)."""
    if not members.headroom_follower:
        return lambda: None
    use, follow = members.use_headroom, members.follow_headroom
    if use is not None:
        use(by_device)
        take_back: Callable[[], None] = lambda: use(None, instead_of=by_device)  # noqa: E731
    else:
        assert follow is not None

        def decide(device: Device, total: int) -> int:
            return by_device[device].in_force(total)[0]

        follow(decide)
        take_back = lambda: follow(None, instead_of=decide)  # noqa: E731
    with _followed_lock:
        before = _followed.get(id(backend))
        if before is not None:
            before.followed = False
        _followed[id(backend)] = by_device
        by_device.followed = True

    def give_up() -> None:
        with _followed_lock:
            if _followed.get(id(backend)) is by_device:
                del _followed[id(backend)]
            by_device.followed = False
        take_back()

    return give_up


def headroom_table(name: str, members: Members, setting: Any,
                   setting_source: str | None) -> tuple[HeadroomByDevice, int | None]:
    """One :class:`Headroom` per device, made on first ask, over the ``headroom`` ``setting`` and the backend's
    own rule; and the setting as an int (checked here: ``InvalidSize`` for one that is no int >= 0)."""
    chosen = None
    if setting is not None:
        setting = as_int(setting, "the headroom setting", "an int >= 0, or None")
        if setting < 0:
            raise InvalidSize(f"the headroom setting must be >= 0 bytes, got {setting}; accepted: an int >= 0")
        chosen = (setting, f"start-up setting headroom (from {setting_source or 'Session(headroom=...)'})")
    return HeadroomByDevice(lambda d: Headroom(d, setting=chosen, own=members.own_headroom, backend=name)), setting


class SessionHeadroom:
    """The headroom verbs of a session: ``by_device`` (its :func:`headroom_table`), ``device`` (a served device),
    ``budget(query, device)`` (a typed budget), ``bound_query`` (the bound verb: traced) and ``raw_query`` (the
    backend's own method: for what no caller asked)."""

    def __init__(self, by_device: HeadroomByDevice, device: Callable[[Any], Device],
                 budget: Callable[[Callable[[Device], Any], Device], Budget], bound_query: Callable[[Device], Any],
                 raw_query: Callable[[Device], Any]):
        self.by_device = by_device
        self._device, self._budget, self._bound, self._raw = device, budget, bound_query, raw_query

    def budget_query(self, device: Any) -> Budget:
        """``Session.budget_query``: the backend's budget with the headroom in force."""
        device = self._device(device)
        b = self._budget(self._bound, device)
        if self.by_device.followed:  # the backend read this very table: the headroom in b is in force
            return b
        room = self.by_device[device].in_force(b.total, b.headroom)[0]
        return b if room == b.headroom else Budget.of(b.total, b.free, room, b.source, b.unified)

    def free_for_host(self, device: Any) -> int:
        """``Session.free_for_host``: one budget query; its free bytes less the headroom without the host's
        own flags, clamped at 0.

        The host accounts for its own flags itself: ComfyUI's ``--reserve-vram`` reaches its load sizing
        through ``extra_reserved_memory()``, and neither it nor ``--vram-headroom`` changes what stock
        ComfyUI's ``get_free_memory`` answers (they bound comfy-aimdo's weights only). Subtracting them here
        as well counted them twice, and changed ComfyUI's choices that read the figure (cond batching in
        ``samplers.calc_cond_batch``, attention slicing, VAE batches), so images under a flag differed from
        stock's under the same flag."""
        device = self._device(device)
        b = self._budget(self._bound, device)
        return max(0, b.free - self.by_device[device].in_force(b.total, b.headroom, flags=False)[0])

    def in_force(self, device: Any) -> tuple[int, str]:
        """``Session.headroom_in_force``: a value set or the setting, else one (untraced) budget query."""
        device = self._device(device)
        h = self.by_device[device]
        chosen = h.chosen()
        if chosen is not None:
            return chosen
        b = self._budget(self._raw, device)  # not traced: no caller asked
        return h.in_force(b.total, b.headroom)

    def set(self, device: Any, headroom: int | None, source: str = HEADROOM_LIVE) -> None:
        """``Session.set_headroom``: checked, then held at ``source``'s level (None: taken away)."""
        device = self._device(device)
        if not isinstance(source, str) or not source.strip():
            raise ConfigError("source", "Session.set_headroom", f"{source!r} names no source",
                              f"{HEADROOM_LIVE!r}, or the start-up flags the value comes from, e.g. "
                              "'comfyui --reserve-vram/--vram-headroom'")
        if headroom is None:
            self.by_device[device].set(None, source)
            return
        total = self._budget(self._raw, device).total
        accepted = f"an int from 0 to {total} (the total bytes of {device})"
        n = as_int(headroom, "headroom", accepted)
        if not 0 <= n <= total:
            raise InvalidSize(f"headroom {n} bytes on {device} is outside 0 to {total} bytes, the device's total; "
                              f"accepted: {accepted}")
        self.by_device[device].set(n, source)
