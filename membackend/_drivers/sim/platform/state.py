"""What the parts of the simulated platform share: its errors, its records and one :class:`SimState`.

The :class:`SimState` is the simulated process's own: the profile, the device memory, the devices, the one
lock, the id source, the host's memory figures and the counters that more than one part keeps. Each part
receives it (or the few items of it that it uses), never the
:class:`~membackend._drivers.sim.platform.SimPlatform` that composes them.

Where a behaviour comes from:

* ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` (from the ``environ``
  given to the platform, not the process's, so a GPU machine's setting never
  changes a simulated one): a comma-separated list of ordinals; the list stops
  at the first entry that is not a valid, unrepeated ordinal; the visible
  devices are renumbered from 0 in that order (CUDA C Programming Guide,
  "CUDA Environment Variables"; ROCm's HIP_VISIBLE_DEVICES, which honours
  CUDA_VISIBLE_DEVICES "for CUDA compatibility" when it is unset).
"""

from __future__ import annotations

import errno
import functools
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, ParamSpec, TypeVar

from ...discovery import visible_ordinals
from ..memory import open_memory
from ..profiles import Profile

_T = TypeVar("_T")
_P = ParamSpec("_P")
NO_FILES = (errno.EMFILE, errno.ENFILE)  # no file descriptor left: the process's limit, or the system's

__all__ = ["SimError", "SimulatedBugcheck", "SimulatedCrash", "SimState", "SimDevice", "SimHandle", "SimMapping",
           "SimReservation", "SimOp", "NO_FILES", "locked", "check_granular"]


class SimulatedBugcheck(BaseException):
    """A kernel use-after-free (a Windows bluescreen). Not an Exception: nothing may catch it as one."""


class SimulatedCrash(BaseException):
    """The process died (an access violation). Not an Exception, for the same reason."""


class SimError(Exception):
    """A driver call failed; ``kind`` is one of oom, invalid, not_ready, invalid_device, invalid_context,
    not_supported, no_device, already_registered, not_registered, injected."""

    def __init__(self, kind: str, detail: str = "", code: Any = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.code = kind, detail, code


# --------------------------------------------------------------------------- records


@dataclass
class SimDevice:
    index: int
    name: str
    vram: int
    arch: str
    integrated: bool
    vmm: bool = True
    used: int = 0  # physical bytes on this device: VMM handles and the process's own allocations
    process: int = 0  # of ``used``, the process's own allocations beside the VMM handles (process_alloc)
    primary_refs: int = 0  # cuDevicePrimaryCtxRetain minus cuDevicePrimaryCtxRelease

    @property
    def spilled(self) -> int:
        """WDDM: bytes past VRAM that live in shared system memory now."""
        return max(0, self.used - self.vram)


@dataclass
class SimHandle:
    id: int
    device: int
    size: int
    mapped_at: set = field(default_factory=set)
    ranges: set = field(default_factory=set)  # bases of the reservations it was ever mapped in (ROCm 7.2)
    released: bool = False
    offset: int = -1  # where its bytes live in the simulated process's memory (-1: books only)


@dataclass
class SimMapping:
    va: int
    size: int
    handle: int
    device: int
    access: bool = False
    trapped: bool = False  # aligned to less than the profile's map_fault_below: kernels fault on it (RDNA4)


@dataclass
class SimReservation:
    base: int
    size: int
    device: int


@dataclass
class SimOp:
    """Asynchronous work: a copy, a kernel, a WDDM page-in. Done once the clock passes ``end``."""

    id: int
    device: int
    stream: int  # -1: the device's paging queue
    end: float
    handles: frozenset
    kind: str
    done: bool = False
    copy: tuple[int, int, int] | None = None  # (destination, host source, size) of a copy's bytes


# --------------------------------------------------------------------------- the shared state


class SimState:
    """One simulated process on one machine, as every part sees it.

    ``profile`` (the machine), ``memory`` (the device memory: real bytes of this process, a ``SimMemory``, or
    books only, a ``BooksOnly`` with its reason), ``devices`` (the visible ones, renumbered from 0), ``lock``,
    ``ids`` (one source for handles, streams, events, work and process allocations) are fixed at start;
    ``host_used`` and ``page_cache`` are the host's memory figures; the rest are counters of hazards and
    fallbacks that tests read. Nothing here is ever replaced, only updated."""

    def __init__(self, profile: Profile, environ: Mapping[str, str], hold_bytes: bool):
        self.profile = profile
        self.memory = open_memory(profile.name, hold_bytes)
        specs = [profile.devices[i] for i in visible_ordinals(len(profile.devices), profile.vendor, environ)]
        self.devices = [SimDevice(i, d.name, d.vram, d.arch, d.integrated, d.vmm) for i, d in enumerate(specs)]
        self.ids = itertools.count(1)
        #: one lock for the whole simulated driver: every API call and sim-only helper holds it, so
        #: threads see each call as one step (real drivers serialise their own tables the same way);
        #: re-entrant because helpers call each other
        self.lock = threading.RLock()
        self.host_used = 0
        self.page_cache = profile.page_cache
        self.spilled_bytes = 0  # WDDM: bytes ever placed past VRAM (sysmem fallback)
        self.bugchecks = 0
        self.crashes = 0
        self.use_after_free = 0
        self.illegal_addresses = 0  # copies whose destination was unmapped before they ran: landed nowhere
        self.descriptor_refusals = 0  # ROCm 7.14: creates refused (as out of memory) for want of a descriptor


def locked(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run a part's ``method`` holding the platform's lock (the part's ``lock``: :attr:`SimState.lock`)."""

    @functools.wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with args[0].lock:  # type: ignore[attr-defined]  # args[0] is the part
            return method(*args, **kwargs)
    return call


def check_granular(granularity: int, size: int, what: str) -> None:
    """``SimError("invalid")`` unless ``size`` is a positive multiple of the allocation ``granularity``."""
    if size <= 0 or size % granularity:
        raise SimError("invalid", f"{what} {size} is not a positive multiple of the granularity {granularity}")
