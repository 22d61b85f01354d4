"""The headroom (the VRAM kept free) of each served device: ComfyUI's flags at start-up and the live cap.

:meth:`Headroom.apply_comfy_flags` turns ComfyUI's ``--reserve-vram`` and ``--vram-headroom`` into the
session's headroom when the runtime starts. :meth:`Headroom.set_live` is the memory panel's cap
(``POST /membackend/headroom``, comfy-aimdo 0.6.0's ``set_vram_headroom``): the next fault sees the new budget,
and what no longer fits under it is given back at once, never a pinned page.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from ..types import Device, InvalidSize, WrongDevice
from .lines import gb, say

if TYPE_CHECKING:
    from .links import RuntimeLinks

__all__ = ["Headroom", "LIVE_SOURCE"]

#: the source a live change is said to come from (``Session.headroom_in_force``'s words)
LIVE_SOURCE = "live change (lasts until ComfyUI stops)"


class Headroom:
    """The headroom of the devices the runtime serves, through its session and its residency manager: what it
    reads of the runtime is ``comfy_args`` (ComfyUI's parsed arguments, or None), ``session()`` (the session,
    None before the start), ``devices()`` (the served devices), ``links`` (the residency manager and why the
    adapter switched itself off), ``device_named(name)``, ``manager()`` (the residency manager, or
    ``RuntimeError``) and ``sample(force=, coalesce=)`` (a history sample)."""

    def __init__(self, comfy_args: Any, session: Callable[[], Any], devices: Callable[[], list[Device]],
                 links: "RuntimeLinks", device_named: Callable[[Any], Device], manager: Callable[[], Any],
                 sample: Callable[..., None]):
        self._args, self._session, self._devices, self._links = comfy_args, session, devices, links
        self._device_named, self._manager, self._sample = device_named, manager, sample
        self._lock = threading.Lock()  # one live change at a time
        #: devices whose last fit left less free room than the headroom (a model of the run kept its pages):
        #: fitted again between nodes, and only those (a budget query per node otherwise)
        self._short: set[Device] = set()

    def apply_comfy_flags(self, extra: dict[Device, int]) -> None:
        """ComfyUI's memory flags reach the budget: ``--reserve-vram`` GB is kept free at least (the larger
        of it and the backend's own headroom, as comfy-aimdo's simple headroom), ``--vram-headroom`` GB
        (``extra``: passed to ``init_devices``, per device) is kept free on top."""
        reserve_gb = getattr(self._args, "reserve_vram", None)
        reserve = int(float(reserve_gb) * 1024 ** 3) if reserve_gb else 0
        session = self._session()
        for dev in self._devices():
            more = max(0, extra.get(dev, 0))
            if not (reserve or more):
                continue
            own = session.budget_query(dev).headroom
            session.set_headroom(dev, max(own, reserve) + more, source="comfyui --reserve-vram/--vram-headroom")

    def in_force(self, device: Device) -> tuple[int, str]:
        """``(bytes kept free on device, where that value came from, in words)``: the session's answer."""
        return self._session().headroom_in_force(device)  # the session's Headroom of the device decides

    def bounds(self, device: Device) -> tuple[int, int]:
        """The live headroom accepted on ``device``: 0 to the device's total, in bytes."""
        return 0, int(self._session().budget_query(device).total)

    def parse(self, device: Device, value: Any) -> int | None:
        """A headroom as the settings read one (``"2GiB"``, ``1.5e9``, bytes; None: back to the start-up
        value); :class:`~membackend.types.InvalidSize` naming the accepted form and range otherwise."""
        from .._settings import SIZE_ACCEPTED, parse_bytes, quoted

        lo, hi = self.bounds(device)
        accepted = f"accepted: {SIZE_ACCEPTED}, from {lo} to {hi} bytes (the total of {device}), or null"
        if value is None:
            return None
        if isinstance(value, float) and value != value:  # NaN: parse_bytes would name it oddly
            raise InvalidSize(f"headroom {quoted(value)} is not a number of bytes; {accepted}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise InvalidSize(f"headroom {quoted(value)} is negative; {accepted}")
        try:
            n = parse_bytes(value)
        except ValueError as exc:
            raise InvalidSize(f"headroom: {exc}; {accepted}") from None
        if n > hi:
            raise InvalidSize(f"headroom {quoted(value)} ({n} bytes) is above the total of {device} ({hi} bytes); "
                              f"{accepted}")
        return n

    def set_live(self, device: Any, value: Any,
                 then: Callable[[int], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Change the headroom (the VRAM kept free) of a served device for the rest of this session.

        ``device`` as ``Runtime.device_named`` reads it, ``value`` as :meth:`parse` reads it. The next fault
        sees the new budget. When the free room is now below the headroom, the residency policy gives back
        what no longer fits: whole idle models first (least recently used), then unpinned pages by priority --
        never a pinned page. Returns the value in force, its source, the bytes freed and the new budget. A bad
        device or value raises (:class:`~membackend.types.WrongDevice`, :class:`~membackend.types.InvalidSize`)
        and changes nothing; a failure while freeing puts the previous headroom back and raises it.
        ``then(bytes in force)`` runs under the same lock once the change holds (the route's save); what it
        returns joins the answer, and if it raises, the previous headroom is put back the same way."""
        session = self._session()
        if session is None or self._links.residency() is None:
            raise WrongDevice("membackend is not running in this ComfyUI; accepted: a live change once it runs")
        dev = self._device_named(device)
        n = self.parse(dev, value)
        with self._lock:
            before, before_source = self.in_force(dev)
            was_live = before_source == LIVE_SOURCE
            session.set_headroom(dev, n, source=LIVE_SOURCE)  # None: back to the start-up value
            try:
                freed = self._fit(dev)
                now, source = self.in_force(dev)
                extra = then(now) if then is not None else {}
            except Exception:
                session.set_headroom(dev, before if was_live else None, source=LIVE_SOURCE)
                raise
        b = session.budget_query(dev)
        say(f"headroom on {dev} is now {gb(now)} ({source}; was {gb(before)}, {before_source})"
            + (f"; gave back {gb(freed)} that no longer fit" if freed else ""))
        self._sample(force=True, coalesce=True)
        return {**extra, "device": str(dev), "headroom": now, "source": source, "previous": before,
                "previous_source": before_source, "freed": freed,
                "budget": {"total": b.total, "free": b.free, "headroom": b.headroom, "usable": b.usable,
                           "source": b.source}}

    def refit(self, every: bool = False) -> int:
        """Between nodes (and, with ``every``, when idle, on every served device): where the last fit left the free
        room below the headroom (a lowered cap that a model of the run kept from being met), give back what fits
        no longer, as a live change does. Returns the bytes freed."""
        if self._session() is None or self._links.residency() is None or self._links.aborted() is not None \
                or not (every or self._short):
            return 0
        freed = 0
        with self._lock:
            for dev in (self._devices() if every else list(self._short)):
                freed += self._fit(dev)
        return freed

    def _fit(self, dev: Device) -> int:
        """Free what no longer fits under the budget of ``dev``: idle models whole, then unpinned pages."""
        session = self._session()
        b = session.budget_query(dev)
        if b.free >= b.headroom:
            self._short.discard(dev)
            return 0
        reason = f"headroom raised to {gb(b.headroom)} (live)"
        residency = self._manager()
        freed = residency.keep_warm(dev, reason=reason)
        b = session.budget_query(dev)
        if b.free < b.headroom:
            freed += residency.free_memory(b.headroom - b.free, dev, reason=reason)
            b = session.budget_query(dev)
        if b.free < b.headroom:
            self._short.add(dev)
        else:
            self._short.discard(dev)
        return freed
