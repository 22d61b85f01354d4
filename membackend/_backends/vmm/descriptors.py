"""Handles that hold file descriptors, chosen by the capabilities' ``descriptors`` group (``handle_descriptors``).

ROCm 7.14 on Linux holds one dmabuf file descriptor of the process for each live ``hipMemCreate`` handle, where
ROCm 7.1.1 kept 3 in all (ROCm/rocm-systems #10604; ROCm/legacy-rocm-build #6661). Under ``ulimit -n 1024`` a
process stops at about 1,015 handles -- 31.7 GiB of 32 MiB pages, a third of a 96 GiB device -- and the runtime
answers ``hipErrorOutOfMemory`` although the memory is there. :class:`HandleDescriptors`:

* **the start** (the backend's first use of a device, before its self-test creates a handle): the soft
  ``RLIMIT_NOFILE`` is raised toward the hard limit as far as the handles can need -- the descriptors open now,
  one per page of every device's memory, and :data:`MARGIN` for the rest of the process -- never lowered,
  never past the hard limit; what it did is said (:attr:`HandleDescriptors.started`, the doctor, the log),
  and a refusal is never raised;
* **a create answered out of memory while fewer than** :data:`SLACK` **descriptors are left** is
  :class:`~membackend.types.DescriptorLimit`, naming the limit, the figure reached and the fix (``ulimit -n``):
  never an out-of-memory answer, which would send the policy to evict models for nothing. The check asks the
  driver how many descriptors the process holds (``GpuDriver.open_descriptors``: ``/proc/self/fd`` on a real
  machine), so it works on the real runtime, which says nothing but out of memory;
* **the room** (:meth:`HandleDescriptors.room`): what a device can map under the limit now, for the doctor.

The number of handles stays bounded by the pages themselves: a handle is one page of device memory (32 MiB on
the ROCm platforms), reused by its range or released, so no more than a device's memory over its page size are
ever alive. Called under the backend's lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

from ..._drivers.gpu import GpuDriver, nofile_limits
from ...types import DescriptorLimit, DriverError, format_size
from .state import DeviceState

log = logging.getLogger(__package__)  # the backend's one logger

#: descriptors left for the rest of the process above one per page: model files, sockets, the runtime's own
MARGIN = 256
#: a create answered out of memory with fewer descriptors free than this ran out of descriptors, not memory
#: (the runtime may have closed the one it opened for the failed call before answering)
SLACK = 2


def _count(n: int | None) -> str:
    return "no limit" if n is None else f"{n:,}"


def handles_of(state: DeviceState) -> int:
    """The live handles ``state`` holds: its resident pages and the handles it and its ranges keep."""
    return state.resident // state.page_size + len(state.spare) + sum(len(r.spare) for r in state.ranges)


@dataclass(frozen=True)
class DescriptorRoom:
    """What one device can map under the process's descriptor limit now (``VmmBackend.descriptor_room``).

    ``limit``/``hard``: the soft and hard ``RLIMIT_NOFILE`` (None: no limit); ``open``: the descriptors the
    process holds now (None: not countable); ``handles``: the device's live handles, ``page_size`` theirs;
    ``started``: what the start did to the limit, in words. ``mappable`` is None where nothing bounds it."""

    device: str
    limit: int | None
    hard: int | None
    open: int | None
    handles: int
    page_size: int
    started: str

    @property
    def free(self) -> int | None:
        """Descriptors left under the soft limit (None: no limit, or none countable)."""
        return None if self.limit is None or self.open is None else max(0, self.limit - self.open)

    @property
    def mappable(self) -> int | None:
        """Bytes the device can hold mapped under the limit: its handles now and one page per free descriptor."""
        free = self.free
        return None if free is None else (self.handles + free) * self.page_size

    def describe(self, budget: int) -> str | None:
        """The doctor's line when :attr:`mappable` is below ``budget`` bytes (what the device may hold), else None."""
        mappable = self.mappable
        if mappable is None or mappable >= budget:
            return None
        return (f"mappable under the descriptor limit: {format_size(mappable)} of budget {format_size(budget)} "
                f"({_count(self.free)} descriptors free of soft limit {_count(self.limit)}, one per "
                f"{format_size(self.page_size)} handle; raise it: ulimit -n)")


class HandleDescriptors:
    """The descriptor budget of one backend (``name``) whose handles each hold a descriptor; ``states()`` are
    its devices' books."""

    def __init__(self, name: str, driver: Callable[[], GpuDriver], states: Callable[[], Mapping[int, DeviceState]]):
        self.name = name
        self._driver = driver
        self._states = states
        #: what the start did to the soft limit, in words (None until the first device is used)
        self.started: str | None = None
        #: the soft limit that serves one descriptor per page of every device (0 until the start)
        self.wanted = 0

    def start(self, page: int) -> None:
        """Raise the soft limit as far as ``page``-byte handles of every device's memory need; once per backend.
        Never raises: a device whose memory cannot be read counts nothing, a refused raise is said."""
        if self.started is not None:
            return
        d = self._driver()
        pages = 0
        try:
            for i in range(d.device_count()):
                pages += -(-d.total_mem(i) // page)
        except DriverError as exc:
            log.warning("membackend: %s: counting the pages the descriptor limit must serve: %s", self.name, exc)
        self.wanted = (d.open_descriptors() or 0) + pages + MARGIN
        self.started = raise_soft_limit(self.wanted, f"{pages:,} handles of {format_size(page)}")
        soft = (nofile_limits() or (None, None))[0]
        log.log(logging.INFO if soft is None or soft >= self.wanted else logging.WARNING,
                "membackend: %s: descriptor limit: %s", self.name, self.started)

    def refusal(self, exc: DriverError, page: int, pending: int = 0) -> DescriptorLimit | None:
        """After a create answered out of memory (``exc``), before anything is rolled back (``pending``: the
        handles the failing fault mapped so far, not in the books yet): the typed error when the process has
        fewer than :data:`SLACK` descriptors left, else None (memory ran out: an out-of-memory answer)."""
        limits, reached = nofile_limits(), self._driver().open_descriptors()
        soft, hard = limits if limits is not None else (None, None)
        if soft is None or reached is None or soft - reached >= SLACK:
            return None
        handles = pending + sum(handles_of(s) for s in self._states().values())
        wanted = max(self.wanted, 2 * soft)  # the start's figure, or twice a limit something else used up
        also = (f" (the hard limit, {hard:,}, is lower: raise it too, as root or in /etc/security/limits.conf)"
                if hard is not None and hard < wanted else "")
        return DescriptorLimit(
            exc.code, exc.call,
            f"the process ran out of file descriptors, not of memory: {reached:,} open of the soft limit {soft:,} "
            f"(RLIMIT_NOFILE), {handles:,} of them held by {self.name}'s live handles of {format_size(page)} "
            f"({format_size(handles * page)}), one per handle (ROCm 7.14 on Linux); start with a higher limit: "
            f"ulimit -n {wanted}{also}",
            limit=soft, reached=reached, handles=handles, wanted=wanted)

    def room(self, device: str, state: DeviceState) -> DescriptorRoom:
        """What ``device`` (its books ``state``) can map under the limit now."""
        soft, hard = nofile_limits() or (None, None)
        return DescriptorRoom(device, soft, hard, self._driver().open_descriptors(), handles_of(state),
                              state.page_size, self.started or "the limit was not looked at yet (no device used)")


def raise_soft_limit(wanted: int, what: str) -> str:
    """Raise this process's soft ``RLIMIT_NOFILE`` toward ``wanted`` (never past the hard limit, never lower);
    what was done, in words naming ``what`` needs it. Never raises."""
    try:
        import resource
    except ImportError:  # Windows: no descriptor limit of this kind
        return "no RLIMIT_NOFILE on this OS: nothing to raise"
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        infinite = resource.RLIM_INFINITY
        if soft == infinite:
            return f"no soft limit (RLIMIT_NOFILE unlimited): nothing to raise for {what}"
        if soft >= wanted:
            return f"soft limit {soft:,} already serves the {wanted:,} wanted ({what})"
        target = wanted if hard == infinite else min(wanted, hard)
        if target <= soft:
            return (f"soft limit {soft:,} could not be raised: the hard limit is {hard:,}, and {what} want "
                    f"{wanted:,} (raise the hard limit as root or in /etc/security/limits.conf, then: ulimit -n "
                    f"{wanted})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("membackend: raising the descriptor limit to %d: %s", wanted, exc)
        return f"could not raise the soft limit toward {wanted:,} ({what}): {exc}"
    short = "" if target >= wanted else f", short of the {wanted:,} wanted (raise the hard limit: ulimit -Hn)"
    return f"soft limit raised from {soft:,} to {target:,} (hard {_count(None if hard == infinite else hard)}) " \
           f"for {what}{short}"
