"""The memory panel's chart: each served device's reserved, resident and committed bytes over the last minutes.

:class:`History` takes at most one sample a second per device (forced samples come on top: a live headroom
change, an idle give-back), keeps :data:`HISTORY_SECONDS` of them and at most :data:`HISTORY_KEPT`, and never
raises: the chart is for people.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

from .lines import log

if TYPE_CHECKING:
    from .._session import Session
    from ..types import Device

__all__ = ["History", "committed_bytes", "HISTORY_SECONDS", "HISTORY_EVERY", "HISTORY_KEPT"]

HISTORY_SECONDS = 600.0  # the status keeps this much of each device's reserved/resident/committed history
HISTORY_EVERY = 1.0  # seconds: at most one history sample per device this often
#: samples kept per device, whatever their age (forced samples come on top of the one a second); a live headroom
#: change's sample replaces one taken less than HISTORY_EVERY before it, so 20,000 changes keep the status small
HISTORY_KEPT = 1000

#: one sample: (epoch seconds, reserved bytes, resident bytes, committed bytes or None)
Sample = tuple[float, int, int, "int | None"]


def committed_bytes(state: Any) -> int:
    """The memory a device's driver holds for this process: the platform's own commit figure where it has one
    (Windows private commit), else the resident pages and what the backend keeps for reuse."""
    return state.committed if state.committed is not None else state.resident + state.held


class History:
    """Per device (by name), its samples, oldest first; safe to share between ComfyUI's threads."""

    def __init__(self) -> None:
        self._samples: dict[str, collections.deque[Sample]] = {}
        self._sampled = 0.0
        self._lock = threading.Lock()

    def sample(self, session: "Session | None", devices: list["Device"], force: bool = False,
               coalesce: bool = False) -> None:
        """Add one sample per device of ``session`` (at most one a second unless ``force``; with ``coalesce``
        it replaces a sample less than a second old). At most :data:`HISTORY_KEPT` samples per device stay,
        none older than :data:`HISTORY_SECONDS`. A sample that fails (a driver that cannot be inspected now) is
        skipped; nothing is sampled before the session is open."""
        if session is None:
            return
        now = time.time()
        if not force and now - self._sampled < HISTORY_EVERY:
            return
        self._sampled = now
        try:
            rows = []
            for d in devices:
                acct = session.ledger.account(d)
                state = session.inspect(d)
                committed = committed_bytes(state) if state is not None else None
                rows.append((str(d), (round(now, 3), acct.reserved, acct.resident, committed)))
        except Exception as exc:  # noqa: BLE001
            log.debug("membackend: history sample skipped: %s: %s", type(exc).__name__, exc)
            return
        with self._lock:
            for key, row in rows:
                hist = self._samples.setdefault(key, collections.deque(maxlen=HISTORY_KEPT))
                if coalesce and hist and now - hist[-1][0] < HISTORY_EVERY:  # a burst of changes: the newest stands
                    hist[-1] = row
                else:
                    hist.append(row)
                while hist and now - hist[0][0] > HISTORY_SECONDS:
                    hist.popleft()

    def as_lists(self) -> dict[str, list[list[Any]]]:
        """Every device's samples as ``[time, reserved, resident, committed]`` lists (the status's ``history``)."""
        with self._lock:
            return {d: [list(x) for x in h] for d, h in self._samples.items()}
