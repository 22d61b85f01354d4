"""Streams, events and the simulated clock: asynchronous work (copies, kernels, WDDM page-ins) and the checks
of memory that work still touches when it is unmapped or released.

Where a behaviour comes from:

* Events capture the work queued on their stream at record time; query says
  not-ready until it is done (cuEventRecord / cuEventQuery).
* WDDM deferred page-in and the bugcheck on release during page-in: ComfyUI
  #16246.
* Bytes: a simulated device holds real bytes (:mod:`~membackend._drivers.sim.memory`): reservations,
  handles and mappings are the operating system's own address space and
  memory, one call for one call. Asynchronous copies move their bytes when
  the simulated stream executes them (at their end on the simulated clock),
  so a read before the fence sees what a GPU would show: the old bytes. A
  copy into a range that is not mapped with access is refused with
  ``..._ERROR_ILLEGAL_ADDRESS`` (CUDA driver API reference: "an illegal memory
  access"); one whose pages were unmapped under it lands nowhere and is
  counted (``illegal_addresses``, a hazard). A copy from a NULL host pointer
  is ``..._ERROR_INVALID_VALUE``, as the real call answers.
"""

from __future__ import annotations

from typing import Callable

from .state import SimError, SimOp, SimState, SimulatedBugcheck, locked

__all__ = ["Streams"]


class Streams:
    """The clock, the pending work (``ops``), the streams (id -> device) and the events (id -> (device, the
    ids of the work it captured) once recorded) of ``state``'s process. ``current()`` is the calling thread's
    device; ``handles_in(va, size, need_access, kind)`` the handles mapped over a range (the mapping table's)."""

    def __init__(self, state: SimState, current: Callable[[], int],
                 handles_in: Callable[..., frozenset]):
        self.lock = state.lock
        self._state = state  # counts hazards
        self._profile = state.profile
        self._memory = state.memory
        self._ids = state.ids
        self._current = current
        self._handles_in = handles_in
        self.clock = 0.0
        self.ops: dict[int, SimOp] = {}
        self.streams: dict[int, int] = {}  # stream id -> device
        self.events: dict[int, tuple[int, frozenset] | None] = {}  # event id -> (device, op ids) once recorded

    # ------------------------------------------------------------------ time and work

    @locked
    def advance(self, seconds: float) -> None:
        """Let simulated time pass; work whose end is reached completes."""
        self.clock += seconds
        self.settle()

    def settle(self) -> None:
        """Work whose end the clock has reached completes, in the order the device ran it."""
        finished = sorted((op for op in self.ops.values() if not op.done and op.end <= self.clock),
                          key=lambda op: (op.end, op.id))
        for op in finished:  # in the order the device ran them: a later copy to the same bytes wins
            op.done = True
            if op.copy is not None:
                self._land(op)
        if finished:
            self.ops = {k: v for k, v in self.ops.items() if not v.done}

    def _land(self, op: SimOp) -> None:
        """A copy's bytes arrive, if its destination is still the memory it was queued on."""
        assert op.copy is not None  # settle lands copies only
        dst, src, size = op.copy
        try:
            still = self._handles_in(dst, size, True) == op.handles
        except SimError:
            still = False
        if not still:  # unmapped under the copy (a race the release check counted): it lands nowhere
            self._state.illegal_addresses += 1
            return
        self._memory.copy(dst, src, size)

    def _complete(self, ops: list[SimOp]) -> None:
        """Block until ``ops`` finish: the clock moves to the last one's end."""
        if ops:
            self.clock = max(self.clock, max(op.end for op in ops))
        self.settle()

    def _pending(self, handles: set[int]) -> list[SimOp]:
        self.settle()
        return [op for op in self.ops.values() if op.handles & handles]

    def queue(self, device: int, stream: int, seconds: float, handles: frozenset, kind: str) -> SimOp:
        """Queue ``seconds`` of work of ``kind`` on ``stream`` of ``device`` (-1: its paging queue) that
        touches ``handles``."""
        # work starts after what its stream queued before it, and after the page-ins of the
        # memory it touches (VidMm makes an allocation resident before work that references it)
        start = max((o.end for o in self.ops.values()
                     if (o.stream == stream and o.device == device) or (o.stream == -1 and o.handles & handles)),
                    default=self.clock)
        op = SimOp(next(self._ids), device, stream, max(start, self.clock) + seconds, handles, kind)
        self.ops[op.id] = op
        return op

    @locked
    def launch(self, stream: int, va: int, size: int, seconds: float) -> int:
        """Sim-only: queue a kernel that reads ``[va, va+size)`` for ``seconds``; returns its op id."""
        device = self._stream_device(stream)
        return self.queue(device, stream, seconds, self._handles_in(va, size, True), "kernel").id

    def release_check(self, handles: set[int], what: str) -> None:
        """Unmapping or releasing memory that asynchronous work still touches."""
        pending = self._pending(handles)
        if not pending:
            return
        if self._profile.unmap_synchronizes:
            self._complete(pending)  # Linux CUDA: the unmap waits (cuMemUnmap docs)
            return
        self._state.use_after_free += 1
        if self._profile.wddm:
            self._state.bugchecks += 1
            kinds = ", ".join(sorted({op.kind for op in pending}))
            raise SimulatedBugcheck(f"{what} while {kinds} is pending: "
                                    "VIDEO_MEMORY_MANAGEMENT_INTERNAL (use after free)")

    def pending_all(self) -> list[SimOp]:
        """Every piece of work not done yet."""
        self.settle()
        return list(self.ops.values())

    # ------------------------------------------------------------------ streams and events

    @locked
    def stream_create(self) -> int:
        sid = next(self._ids)
        self.streams[sid] = self._current()
        return sid

    def _stream_device(self, stream: int) -> int:
        if stream == 0:
            return self._current()  # the legacy default stream of the current device
        if stream not in self.streams:
            raise SimError("invalid", f"no stream {stream}")
        return self.streams[stream]

    @locked
    def stream_synchronize(self, stream: int) -> None:
        device = self._stream_device(stream)
        self.settle()
        self._complete([op for op in self.ops.values() if op.stream == stream and op.device == device])

    @locked
    def device_synchronize(self) -> None:
        """Everything queued on the current device, the paging queue included, finishes."""
        self.settle()
        self._complete([op for op in self.ops.values() if op.device == self._current()])

    @locked
    def copy_async(self, dst: int, size: int, stream: int, src: int = 0) -> int:
        """Queue a host-to-device copy of ``size`` bytes from host address ``src``; its bytes arrive when
        the stream runs it. Books only: ``src`` may be 0 (a modelled copy)."""
        device = self._stream_device(stream)
        if self._memory.backed and not src:
            raise SimError("invalid", "the host source of a copy is NULL")
        handles = self._handles_in(dst, size, True, kind="illegal_address")
        op = self.queue(device, stream, size / self._profile.copy_bandwidth, handles, "copy")
        if self._memory.backed:
            op.copy = (dst, src, size)
        return op.id

    @locked
    def copy_sync(self, dst: int, src: int, size: int, to_device: bool) -> None:
        """``cuMemcpyHtoD`` / ``cuMemcpyDtoH``: after the work queued before it (the legacy default
        stream synchronises with every stream of the device), the bytes move now. The device side must be
        mapped with access: ``..._ERROR_ILLEGAL_ADDRESS`` otherwise."""
        if not src or not dst:
            raise SimError("invalid", "a host or device pointer of the copy is NULL")
        device_side = dst if to_device else src
        self._handles_in(device_side, size, True, kind="illegal_address")
        self.settle()
        self._complete([op for op in self.ops.values() if op.device == self._current()])
        if not self._memory.backed:
            raise SimError("not_supported", f"the simulated memory keeps books only ({self._memory.reason})")
        self._memory.copy(dst, src, size)

    @locked
    def read(self, va: int, size: int) -> bytes:
        """Sim-only: the bytes a device range holds now (no wait for queued work); a range that is not
        mapped with access is ``illegal_address``, never read."""
        self._handles_in(va, size, True, kind="illegal_address")
        if not self._memory.backed:
            raise SimError("not_supported", f"the simulated memory keeps books only ({self._memory.reason})")
        self.settle()
        return self._memory.read(va, size)

    @locked
    def event_create(self) -> int:
        eid = next(self._ids)
        self.events[eid] = None
        return eid

    @locked
    def event_record(self, event: int, stream: int) -> None:
        if event not in self.events:
            raise SimError("invalid", f"no event {event}")
        device = self._stream_device(stream)
        self.settle()
        self.events[event] = (device, frozenset(op.id for op in self.ops.values()
                                                if op.stream == stream and op.device == device))

    @locked
    def event_query(self, event: int) -> bool:
        if event not in self.events:
            raise SimError("invalid", f"no event {event}")
        self.settle()
        rec = self.events[event]
        return rec is None or not (rec[1] & self.ops.keys())

    @locked
    def event_synchronize(self, event: int) -> None:
        if event not in self.events:
            raise SimError("invalid", f"no event {event}")
        rec = self.events[event]
        if rec is not None:
            self.settle()
            self._complete([self.ops[i] for i in rec[1] if i in self.ops])

    @locked
    def event_destroy(self, event: int) -> None:
        if self.events.pop(event, "missing") == "missing":
            raise SimError("invalid", f"no event {event}")
