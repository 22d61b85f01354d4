"""The state behind the simulated CUDA and HIP drivers.

One :class:`SimPlatform` is one process on one simulated machine: devices with
VRAM, a per-process GPU address space, physical handles, mappings, streams
with pending asynchronous work, events, and host RAM with private-commit
accounting. The API surfaces in ``cuda.py`` and ``hip.py`` translate driver
calls into the methods here and the ``SimError`` kinds into each vendor's
error codes.

``SimPlatform`` is a front over parts, built in one place (:mod:`.parts`: :func:`.parts.build_parts`, whose
docstring tables what each part calls); each part holds only the state and the bound calls it uses, never the
front, and the front binds each call to its part once, so a driver call reaches the part's method directly:

* :mod:`.state` -- the errors, the records and the shared state (profile, device memory, devices, lock, ids,
  the host's figures, the hazard counters);
* :mod:`.contexts` -- the current device per thread, primary contexts, start-up, fault injection
  (:mod:`.faults`);
* :mod:`.address` -- reservations of the address space, its quota and commit charge;
* :mod:`.mappings` and :mod:`.handles` -- the mapping table; physical handles and their mappings;
* :mod:`.streams` -- the clock, streams, events, copies, and the checks of memory that work still touches;
* :mod:`.hostmem` -- host, pinned and registered memory, the process's own device allocations;
* :mod:`.facts` -- what the driver and the host report, whether more device memory fits, the driver's tables.

Where a behaviour comes from: each part's module docstring lists the public sources of what it simulates --
VMM call rules, the ROCm 7.2 held memory and ROCm 7.14's descriptor per handle, devices without VMM:
:mod:`.handles`; events, WDDM deferred page-in and its bugcheck, real bytes and copies: :mod:`.streams`;
WDDM's sysmem fallback, unified memory, AMD APUs' carve-out and GTT: :mod:`.facts`; commit-charged
reservations, the address quota, the churn defect, the address space: :mod:`.address`; RDNA4's map faults:
:mod:`.mappings`; the current device per thread, primary contexts, a device that is not current:
:mod:`.contexts`; ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES``: :mod:`.state`.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Generic, Mapping, TypeVar, overload

from ..profiles import Profile, get_profile
from .address import VA_BASE, VA_SPACE
from .faults import FaultPlan, FaultRule
from .parts import Parts, build_parts
from .state import SimError, SimOp, SimulatedBugcheck, SimulatedCrash

__all__ = ["SimPlatform", "SimError", "SimulatedBugcheck", "SimulatedCrash", "FaultPlan", "FaultRule"]

_V = TypeVar("_V")


class _On(Generic[_V]):
    """An attribute of the platform that lives on one of its parts (a field of :class:`~.parts.Parts`): read
    and written there, so the part that changes it and the caller that reads it see one value."""

    def __init__(self, part: str):
        self._part = operator.attrgetter(f"_parts.{part}")

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _On[_V]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _V: ...
    def __get__(self, obj: object | None, owner: type) -> Any:
        return self if obj is None else getattr(self._part(obj), self._name)

    def __set__(self, obj: object, value: _V) -> None:
        setattr(self._part(obj), self._name, value)


class SimPlatform:
    """The simulated machine and process; see the module docstring for its parts and their sources."""

    VA_BASE = VA_BASE
    #: bytes of address space all reservations together may hold (see :mod:`.address`)
    VA_SPACE = VA_SPACE

    # values a part changes (or a test sets): each read and written on its part
    faults = _On[FaultPlan]("contexts")
    initialized = _On[bool]("contexts")
    clock = _On[float]("streams")
    ops = _On[dict[int, SimOp]]("streams")  # replaced as work completes
    #: the process's address space for reservations, :attr:`VA_SPACE`; a test may make it smaller to fill it
    #: with a few models
    va_space = _On[int]("address")
    churn_frees = _On[int]("address")
    private_commit = _On[int]("address")
    host_used = _On[int]("state")
    page_cache = _On[int]("state")
    spilled_bytes = _On[int]("state")  # WDDM: bytes ever placed past VRAM (sysmem fallback)
    bugchecks = _On[int]("state")
    crashes = _On[int]("state")
    use_after_free = _On[int]("state")
    illegal_addresses = _On[int]("state")  # copies whose destination was unmapped before they ran: landed nowhere
    descriptor_refusals = _On[int]("state")  # ROCm 7.14: creates refused (as out of memory) for want of a descriptor

    def __init__(self, profile: Profile | str, faults: FaultPlan | None = None,
                 environ: Mapping[str, str] | None = None, hold_bytes: bool = True):
        self._parts: Parts = build_parts(get_profile(profile) if isinstance(profile, str) else profile,
                                         faults or FaultPlan(), environ or {}, hold_bytes)
        state, contexts, address, handles = self._parts.state, self._parts.contexts, self._parts.address, \
            self._parts.handles
        streams, facts, host = self._parts.streams, self._parts.facts, self._parts.host
        # what never changes, the same objects the parts hold
        self.profile = state.profile
        #: the device memory: real bytes of this process (SimMemory), or books only (BooksOnly, with its reason)
        self.memory = state.memory
        weakref.finalize(self, self.memory.close)  # the simulated process ends with this object
        self.devices = state.devices
        #: one lock for the whole simulated driver (see :class:`~.state.SimState`)
        self.lock = state.lock
        self.reservations = address.reservations
        self.handles = handles.handles
        self.held_released = handles.held_released  # ROCm 7.2: released, memory held until its ranges are freed
        self.mappings = self._parts.table.mappings
        self.streams = streams.streams  # stream id -> device
        self.events = streams.events  # event id -> (device, op ids) once recorded
        #: cuMemHostRegister / hipHostRegister: the page-locked ranges of the process's own memory, base -> size
        self.host_registered = host.host_registered
        #: the process's own device allocations beside the VMM handles: id -> (device, bytes); see process_alloc
        self.process_allocs = host.process_allocs

        # the calls, each bound once to the part that answers it: nothing between a driver call and its part
        self._device = contexts.device
        self._current_device, self._current_context = contexts.current, contexts.current_context
        self.set_current, self.set_current_context = contexts.set_current, contexts.set_current_context
        self.require_context, self.init, self.inject = contexts.require_context, contexts.init, contexts.inject
        self.primary_retain, self.primary_release = contexts.primary_retain, contexts.primary_release
        self.quota_used = address.quota_used
        self.address_reserve, self.address_free = address.reserve, address.free
        self.create, self.release = handles.create, handles.release
        self.map, self.set_access, self.unmap = handles.map, handles.set_access, handles.unmap
        self.descriptors_held, self.shed_memory = handles.descriptors_held, handles.shed_memory
        self.advance, self.launch = streams.advance, streams.launch
        self.stream_create, self.stream_synchronize = streams.stream_create, streams.stream_synchronize
        self.device_synchronize = streams.device_synchronize
        self.copy_async, self.copy_sync, self.read = streams.copy_async, streams.copy_sync, streams.read
        self.event_create, self.event_record = streams.event_create, streams.event_record
        self.event_query, self.event_synchronize = streams.event_query, streams.event_synchronize
        self.event_destroy = streams.event_destroy
        self.luid, self.pci_location = facts.luid, facts.pci_location
        self.mem_get_info, self.meminfo = facts.mem_get_info, facts.meminfo
        self.amdgpu_sysfs, self.wddm_budget = facts.amdgpu_sysfs, facts.wddm_budget
        self.host_alloc, self.host_free = host.host_alloc, host.host_free
        self.pinned_alloc, self.pinned_free = host.pinned_alloc, host.pinned_free
        self.host_register, self.host_unregister = host.host_register, host.host_unregister
        self.process_alloc, self.process_free = host.process_alloc, host.process_free
        self.process_bytes = host.process_bytes
        self.state = self._parts.tables.state

    @property
    def current(self) -> int:
        """The calling thread's current device: HIP's (0 until set), or the device of the CUDA
        context bound to the thread."""
        return self._current_device()

    @property
    def current_context(self) -> int:
        """``cuCtxGetCurrent``: the context bound to the calling thread, 0 (NULL) when none is."""
        return self._current_context()
