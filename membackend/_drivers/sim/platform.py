"""The state behind the simulated CUDA and HIP drivers.

One :class:`SimPlatform` is one process on one simulated machine: devices with
VRAM, a per-process GPU address space, physical handles, mappings, streams
with pending asynchronous work, events, and host RAM with private-commit
accounting. The API surfaces in ``cuda.py`` and ``hip.py`` translate driver
calls into the methods here and the ``SimError`` kinds into each vendor's
error codes.

Where a behaviour comes from:

* VMM call rules (granularity multiples, whole-mapping unmaps, access after
  map, reservations freed only when unmapped): CUDA driver API reference,
  "Virtual Memory Management" (cuMemAddressReserve, cuMemCreate, cuMemMap,
  cuMemUnmap, cuMemSetAccess, cuMemRelease); HIP mirrors it (hip_runtime_api.h).
* Events capture the work queued on their stream at record time; query says
  not-ready until it is done (cuEventRecord / cuEventQuery).
* WDDM deferred page-in and the bugcheck on release during page-in: ComfyUI
  #16246. Sysmem fallback past the budget: ComfyUI PR #11845, aimdo
  ``shmem-detect.c`` (DXGI QueryVideoMemoryInfo Budget).
* ROCm/Windows commit-charged reservations: ComfyUI #15993. The 256 GiB
  address quota and its access violation: rocm-systems #9823 / ComfyUI PR
  #16199. The churn defect: rocm-systems #6191, aimdo PR #67. Operations on a
  device that is not current: TheRock #6224.
* Address space: the devices' virtual addresses are the process's (CUDA C Programming Guide, "Unified
  Virtual Address Space"), so reservations together get at most the process's user address space,
  ``va_space`` (128 TiB: x86-64 Linux with 4-level page tables, the kernel's
  Documentation/arch/x86/x86_64/mm.rst); past it ``cuMemAddressReserve`` is CUDA_ERROR_OUT_OF_MEMORY (CUDA
  driver API reference, cuMemAddressReserve's return values, cuda.h) and ``hipMemAddressReserve``
  hipErrorOutOfMemory (ROCm clr, hipamd/src/hip_vm.cpp: no range found), in books-only mode too. Where
  the bytes are real, the kernel may refuse a range earlier (the rest of the process shares its space):
  the same answer.
* Bytes: a simulated device holds real bytes (:mod:`.memory`): reservations,
  handles and mappings are the operating system's own address space and
  memory, one call for one call. Asynchronous copies move their bytes when
  the simulated stream executes them (at their end on the simulated clock),
  so a read before the fence sees what a GPU would show: the old bytes. A
  copy into a range that is not mapped with access is refused with
  ``..._ERROR_ILLEGAL_ADDRESS`` (CUDA driver API reference: "an illegal memory
  access"); one whose pages were unmapped under it lands nowhere and is
  counted (``illegal_addresses``, a hazard). A copy from a NULL host pointer
  is ``..._ERROR_INVALID_VALUE``, as the real call answers.
* Unified memory: MemFree excludes the page cache that MemAvailable counts
  (proc(5), /proc/meminfo); device pages and host copies share the pool
  (ComfyUI #15285, unsloth PR #11208).
* AMD APUs and AMD GPUs on Linux (public reports, membackend issue 27): on
  Strix Halo a BIOS carve-out shows as sysfs VRAM and the rest is GTT
  (``mem_info_gtt_total`` = ``ttm.pages_limit`` x 4096, Linux amdgpu
  documentation); ``hipMemGetInfo`` reported free 120.00 GiB above its total
  of 62.47 GiB (``hip_free_is_host_free``: free is the host's MemFree, total
  the GTT). ROCm 7.2 returns a released handle's memory only when the
  address range it was mapped in is freed, not on unmap alone (vLLM frees and
  re-reserves the range): ``memory_held_until_address_free``. RDNA4 reports
  4 KiB VMM granularity but kernels fault on mappings aligned to less than
  2 MiB (``map_fault_below``): such a mapping succeeds, and work that touches
  it is a GPU memory access fault, counted as an illegal address.
* ROCm 7.14 on Linux holds one dmabuf file descriptor of the process per live
  ``hipMemCreate`` handle, where ROCm 7.1.1 kept 3 in all (ROCm/rocm-systems
  #10604; ROCm/legacy-rocm-build #6661): gfx1030, gfx1100, gfx1151 and gfx1201
  stop at 1,015 handles under ``ulimit -n 1024``, and the call answers
  hipErrorOutOfMemory although what ran out is the descriptors
  (``Profile.descriptor_per_handle``). The simulation takes no real descriptor:
  it counts its live handles on top of the descriptors the process has open
  (``process_descriptors``) against the process's soft ``RLIMIT_NOFILE``, read
  at each create (so a raised limit counts at once), and counts each refusal
  (``descriptor_refusals``).
* The current device is per host thread: CUDA driver API reference,
  ``cuCtxSetCurrent`` ("binds the specified CUDA context to the calling CPU
  thread") and ``cuCtxGetCurrent`` (NULL and CUDA_SUCCESS when none is bound);
  HIP runtime API, ``hipSetDevice`` ("the default device for the calling host
  thread"; 0 until set). A primary context is reference counted:
  ``cuDevicePrimaryCtxRetain`` / ``cuDevicePrimaryCtxRelease`` (releasing one
  that is not retained is CUDA_ERROR_INVALID_CONTEXT).
* A device without virtual memory management support fails ``cuMemCreate`` /
  ``hipMemCreate`` with ...NOT_SUPPORTED (CUDA driver API reference,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; ROCm/hip #3151).
* ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` (from the ``environ``
  given to the platform, not the process's, so a GPU machine's setting never
  changes a simulated one): a comma-separated list of ordinals; the list stops
  at the first entry that is not a valid, unrepeated ordinal; the visible
  devices are renumbered from 0 in that order (CUDA C Programming Guide,
  "CUDA Environment Variables"; ROCm's HIP_VISIBLE_DEVICES, which honours
  CUDA_VISIBLE_DEVICES "for CUDA compatibility" when it is unset).
"""

from __future__ import annotations

import bisect
import errno
import functools
import itertools
import random
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from ..discovery import visible_ordinals
from ..gpu import nofile_limits, process_descriptors
from .memory import MemoryCallFailed, open_memory
from .profiles import Profile, get_profile

_T = TypeVar("_T")
NO_FILES = (errno.EMFILE, errno.ENFILE)  # no file descriptor left: the process's limit, or the system's

__all__ = ["SimPlatform", "SimError", "SimulatedBugcheck", "SimulatedCrash", "FaultPlan", "FaultRule"]


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


# --------------------------------------------------------------------------- fault injection


@dataclass
class FaultRule:
    """Fail ``call`` with ``error`` (a vendor error code) on its ``nth`` call, or with ``probability``."""

    call: str
    error: object
    nth: int | None = None
    probability: float = 0.0
    times: int | None = None  # at most this many injections (None: unlimited)
    fired: int = 0


class FaultPlan:
    """Deterministic fault injection: rules by API name, a seeded random source."""

    def __init__(self, rules: list[FaultRule] | None = None, seed: int = 0):
        self.rules = list(rules or [])
        self.rng = random.Random(seed)
        self.calls: dict[str, int] = {}
        self.injected = 0

    def add(self, call: str, error: object, nth: int | None = None, probability: float = 0.0,
            times: int | None = None) -> FaultRule:
        rule = FaultRule(call, error, nth, probability, times)
        self.rules.append(rule)
        return rule

    def check(self, call: str) -> object | None:
        n = self.calls[call] = self.calls.get(call, 0) + 1
        for rule in self.rules:
            if rule.call != call or (rule.times is not None and rule.fired >= rule.times):
                continue
            if (rule.nth is not None and rule.nth == n) or (rule.probability and self.rng.random() < rule.probability):
                rule.fired += 1
                self.injected += 1
                return rule.error
        return None


# --------------------------------------------------------------------------- state


@dataclass
class _Device:
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
class _Handle:
    id: int
    device: int
    size: int
    mapped_at: set = field(default_factory=set)
    ranges: set = field(default_factory=set)  # bases of the reservations it was ever mapped in (ROCm 7.2)
    released: bool = False
    offset: int = -1  # where its bytes live in the simulated process's memory (-1: books only)


@dataclass
class _Mapping:
    va: int
    size: int
    handle: int
    device: int
    access: bool = False
    trapped: bool = False  # aligned to less than the profile's map_fault_below: kernels fault on it (RDNA4)


@dataclass
class _Reservation:
    base: int
    size: int
    device: int


@dataclass
class _Op:
    """Asynchronous work: a copy, a kernel, a WDDM page-in. Done once the clock passes ``end``."""

    id: int
    device: int
    stream: int  # -1: the device's paging queue
    end: float
    handles: frozenset
    kind: str
    done: bool = False
    copy: tuple[int, int, int] | None = None  # (destination, host source, size) of a copy's bytes

def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` holding the platform's lock (see :attr:`SimPlatform.lock`)."""

    @functools.wraps(method)
    def call(self: "SimPlatform", *args: Any, **kwargs: Any) -> _T:
        with self.lock:
            return method(self, *args, **kwargs)
    return call


class SimPlatform:
    """The simulated machine and process; see the module docstring for its sources."""

    VA_BASE = 0x7F00_0000_0000
    #: bytes of address space all reservations together may hold (see the module docstring)
    VA_SPACE = 1 << 47

    def __init__(self, profile: Profile | str, faults: FaultPlan | None = None,
                 environ: Mapping[str, str] | None = None, hold_bytes: bool = True):
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        p = self.profile
        #: the device memory: real bytes of this process (SimMemory), or books only (BooksOnly, with its reason)
        self.memory = open_memory(p.name, hold_bytes)
        weakref.finalize(self, self.memory.close)  # the simulated process ends with this object
        specs = [p.devices[i] for i in visible_ordinals(len(p.devices), p.vendor, environ or {})]
        self.devices = [_Device(i, d.name, d.vram, d.arch, d.integrated, d.vmm) for i, d in enumerate(specs)]
        self.faults = faults or FaultPlan()
        self.clock = 0.0
        self._ids = itertools.count(1)
        self._next_va = self.VA_BASE
        #: the process's address space for reservations, :attr:`VA_SPACE`; a test may make it smaller to fill it
        #: with a few models
        self.va_space = self.VA_SPACE
        self.reservations: dict[int, _Reservation] = {}
        self.handles: dict[int, _Handle] = {}
        self.mappings: dict[int, _Mapping] = {}
        self._starts: list[int] = []  # sorted mapping addresses, for range look-ups
        self._reserved_total = 0
        self._mapped_total = 0
        self.ops: dict[int, _Op] = {}
        self.streams: dict[int, int] = {}  # stream id -> device
        self.events: dict[int, tuple[int, frozenset] | None] = {}  # event id -> (device, op ids) once recorded
        self.host_used = 0
        #: cuMemHostRegister / hipHostRegister: the page-locked ranges of the process's own memory, base -> size
        self.host_registered: dict[int, int] = {}
        self.page_cache = p.page_cache
        self.private_commit = 0
        self.churn_frees = 0
        self.spilled_bytes = 0  # WDDM: bytes ever placed past VRAM (sysmem fallback)
        self.bugchecks = 0
        self.crashes = 0
        self.use_after_free = 0
        self.illegal_addresses = 0  # copies whose destination was unmapped before they ran: landed nowhere
        self.descriptor_refusals = 0  # ROCm 7.14: creates refused (as out of memory) for want of a descriptor
        self.held_released: dict[int, _Handle] = {}  # ROCm 7.2: released, memory held until its ranges are freed
        #: the process's own device allocations beside the VMM handles (its context, its runtime allocator's
        #: blocks): id -> (device, bytes); see process_alloc
        self.process_allocs: dict[int, tuple[int, int]] = {}
        self._current = threading.local()  # per thread: .device (HIP's, or the CUDA context's) and .ctx
        #: one lock for the whole simulated driver: every API call and sim-only helper holds it, so
        #: threads see each call as one step (real drivers serialise their own tables the same way);
        #: re-entrant because helpers call each other
        self.lock = threading.RLock()
        self.initialized = False

    # ------------------------------------------------------------------ helpers

    @property
    def current(self) -> int:
        """The calling thread's current device: HIP's (0 until set), or the device of the CUDA
        context bound to the thread."""
        return getattr(self._current, "device", 0)

    def set_current(self, device: int) -> None:
        """``hipSetDevice``: the calling thread's device."""
        self._device(device)
        self._current.device = device

    # CUDA contexts: one primary context per device, handle = index + 1 (0 is NULL)

    @property
    def current_context(self) -> int:
        """``cuCtxGetCurrent``: the context bound to the calling thread, 0 (NULL) when none is."""
        return getattr(self._current, "ctx", 0)

    def set_current_context(self, ctx: int) -> None:
        """``cuCtxSetCurrent``: bind ``ctx`` (0 unbinds) to the calling thread."""
        if ctx:
            self._device(ctx - 1)
            self._current.device = ctx - 1
        self._current.ctx = ctx

    def require_context(self) -> None:
        """Calls whose documented errors include CUDA_ERROR_INVALID_CONTEXT need a bound context."""
        if not self.current_context:
            raise SimError("invalid_context", "no CUDA context is current on this thread")

    @_locked
    def primary_retain(self, device: int) -> int:
        d = self._device(device)
        d.primary_refs += 1
        return device + 1

    @_locked
    def primary_release(self, device: int) -> None:
        d = self._device(device)
        if d.primary_refs <= 0:
            raise SimError("invalid_context", f"the primary context of device {device} is not retained")
        d.primary_refs -= 1

    def _device(self, index: int) -> _Device:
        if not isinstance(index, int) or not 0 <= index < len(self.devices):
            raise SimError("invalid_device", f"no device {index}")
        return self.devices[index]

    def _check_current(self, device: int, what: str) -> None:
        if self.profile.current_device_checked and device != self.current:
            raise SimError("invalid_device", f"{what} belongs to device {device} but device {self.current} is current")

    def _granular(self, size: int, what: str) -> None:
        g = self.profile.granularity
        if size <= 0 or size % g:
            raise SimError("invalid", f"{what} {size} is not a positive multiple of the granularity {g}")

    @_locked
    def inject(self, call: str) -> None:
        code = self.faults.check(call)
        if code is not None:
            raise SimError("injected", f"{call} failed by fault injection", code)

    # ------------------------------------------------------------------ time and work

    @_locked
    def advance(self, seconds: float) -> None:
        """Let simulated time pass; work whose end is reached completes."""
        self.clock += seconds
        self._settle()

    def _settle(self) -> None:
        finished = sorted((op for op in self.ops.values() if not op.done and op.end <= self.clock),
                          key=lambda op: (op.end, op.id))
        for op in finished:  # in the order the device ran them: a later copy to the same bytes wins
            op.done = True
            if op.copy is not None:
                self._land(op)
        if finished:
            self.ops = {k: v for k, v in self.ops.items() if not v.done}

    def _land(self, op: _Op) -> None:
        """A copy's bytes arrive, if its destination is still the memory it was queued on."""
        assert op.copy is not None  # _settle lands copies only
        dst, src, size = op.copy
        try:
            still = self._handles_in(dst, size, True) == op.handles
        except SimError:
            still = False
        if not still:  # unmapped under the copy (a race the release check counted): it lands nowhere
            self.illegal_addresses += 1
            return
        self.memory.copy(dst, src, size)

    def _complete(self, ops: list[_Op]) -> None:
        """Block until ``ops`` finish: the clock moves to the last one's end."""
        if ops:
            self.clock = max(self.clock, max(op.end for op in ops))
        self._settle()

    def _pending(self, handles: set[int]) -> list[_Op]:
        self._settle()
        return [op for op in self.ops.values() if op.handles & handles]

    def _queue(self, device: int, stream: int, seconds: float, handles: frozenset, kind: str) -> _Op:
        # work starts after what its stream queued before it, and after the page-ins of the
        # memory it touches (VidMm makes an allocation resident before work that references it)
        start = max((o.end for o in self.ops.values()
                     if (o.stream == stream and o.device == device) or (o.stream == -1 and o.handles & handles)),
                    default=self.clock)
        op = _Op(next(self._ids), device, stream, max(start, self.clock) + seconds, handles, kind)
        self.ops[op.id] = op
        return op

    def _overlapping(self, va: int, size: int) -> list[_Mapping]:
        """Mappings that intersect ``[va, va+size)``, in address order."""
        i = bisect.bisect_right(self._starts, va) - 1
        found = []
        for start in self._starts[max(i, 0):]:
            if start >= va + size:
                break
            m = self.mappings[start]
            if m.va + m.size > va:
                found.append(m)
        return found

    def _handles_in(self, va: int, size: int, need_access: bool, kind: str = "invalid") -> frozenset:
        found, pos = set(), va
        for m in self._overlapping(va, size):
            if m.va > pos:
                break
            if need_access and not m.access:
                raise SimError(kind, f"range at {m.va:#x} has no access set (cuMemSetAccess)")
            if need_access and m.trapped:  # RDNA4: kernels fault on mappings aligned to less than 2 MiB
                self.illegal_addresses += 1
                raise SimError("illegal_address", f"memory access fault by GPU: the mapping at {m.va:#x} "
                                                  f"({m.size} bytes) is aligned to less than "
                                                  f"{self.profile.map_fault_below} bytes")
            found.add(m.handle)
            pos = m.va + m.size
        if pos < va + size:
            raise SimError(kind, f"range [{va:#x}, {va + size:#x}) is not fully mapped")
        return frozenset(found)

    @_locked
    def launch(self, stream: int, va: int, size: int, seconds: float) -> int:
        """Sim-only: queue a kernel that reads ``[va, va+size)`` for ``seconds``; returns its op id."""
        device = self._stream_device(stream)
        return self._queue(device, stream, seconds, self._handles_in(va, size, True), "kernel").id

    def _release_check(self, handles: set[int], what: str) -> None:
        """Unmapping or releasing memory that asynchronous work still touches."""
        pending = self._pending(handles)
        if not pending:
            return
        if self.profile.unmap_synchronizes:
            self._complete(pending)  # Linux CUDA: the unmap waits (cuMemUnmap docs)
            return
        self.use_after_free += 1
        if self.profile.wddm:
            self.bugchecks += 1
            kinds = ", ".join(sorted({op.kind for op in pending}))
            raise SimulatedBugcheck(f"{what} while {kinds} is pending: VIDEO_MEMORY_MANAGEMENT_INTERNAL (use after free)")

    # ------------------------------------------------------------------ devices and contexts

    @_locked
    def init(self) -> None:
        self.inject("init")
        self.initialized = True

    def luid(self, device: int) -> bytes:
        """The adapter LUID (8 bytes: LowPart, HighPart, little-endian) DXGI would know the device by."""
        self._device(device)
        return (0x0000C0DE + device).to_bytes(4, "little") + (0).to_bytes(4, "little")

    def pci_location(self, device: int) -> tuple[int, int, int]:
        """(domain, bus, device) of the simulated board: one bus per device."""
        self._device(device)
        return 0, 0x01 + device, 0

    @_locked
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as the driver reports them for the current device."""
        d = self._device(self.current)
        if self.profile.hip_free_is_host_free:  # Strix Halo: free above total (issue 27's reports)
            return self.meminfo()["MemFree"], d.vram
        if self.profile.unified:
            info = self.meminfo()
            return info["MemFree"], info["MemTotal"]  # MemFree, not MemAvailable (#15285)
        return max(0, d.vram - d.used), d.vram

    @_locked
    def meminfo(self) -> dict[str, int]:
        """The host's /proc/meminfo view: MemAvailable counts the reclaimable page cache."""
        total = self.profile.host_ram
        if self.profile.unified:
            used = self.host_used + sum(d.used for d in self.devices)
        else:  # WDDM spill lives in system memory
            used = self.host_used + sum(d.spilled for d in self.devices)
        free = max(0, total - used - self.page_cache)
        return {"MemTotal": total, "MemFree": free, "MemAvailable": max(0, total - used)}

    @_locked
    def amdgpu_sysfs(self, device: int) -> dict[str, int]:
        """The amdgpu driver's ``mem_info_*`` files of the device: on an APU the carve-out as VRAM and
        device memory as GTT; on a discrete card its VRAM, and a GTT of half the host's RAM, unused."""
        d, p = self._device(device), self.profile
        if d.integrated:
            return {"vram_total": p.carveout, "vram_used": 0, "gtt_total": p.gtt or d.vram, "gtt_used": d.used}
        return {"vram_total": d.vram, "vram_used": d.used, "gtt_total": p.host_ram // 2, "gtt_used": 0}

    @_locked
    def wddm_budget(self, device: int) -> int:
        """DXGI QueryVideoMemoryInfo(LOCAL).Budget: VRAM minus what the OS keeps."""
        return self._device(device).vram - self.profile.wddm_budget_headroom

    # ------------------------------------------------------------------ host memory

    @_locked
    def host_alloc(self, size: int) -> None:
        """Host memory (a pinned buffer, a host copy of weights); on unified memory it is the GPU pool."""
        if self.meminfo()["MemAvailable"] < size:
            raise SimError("oom", f"host allocation of {size} bytes")
        take_cache = min(self.page_cache, max(0, size - self.meminfo()["MemFree"]))
        self.page_cache -= take_cache  # the kernel reclaims page cache before failing
        self.host_used += size

    @_locked
    def host_free(self, size: int) -> None:
        self.host_used = max(0, self.host_used - size)

    @_locked
    def pinned_alloc(self, size: int) -> int:
        """``cuMemAllocHost``: page-locked host memory, counted as :meth:`host_alloc`; its address (books
        only: the size stands in for it, there being no bytes)."""
        if not self.memory.backed:
            self.host_alloc(size)
            return size
        try:
            address = self.memory.host_alloc(size)
        except MemoryCallFailed as exc:
            raise SimError("oom", f"host allocation of {size} bytes: {exc}") from None
        try:
            self.host_alloc(size)
        except SimError:
            self.memory.host_free(address)
            raise
        return address

    @_locked
    def pinned_free(self, address: int) -> None:
        """``cuMemFreeHost``."""
        if not self.memory.backed:
            self.host_free(address)
            return
        try:
            size = self.memory.host_free(address)
        except KeyError:
            raise SimError("invalid", f"{address:#x} is not memory cuMemAllocHost returned") from None
        self.host_free(size)

    @_locked
    def host_register(self, address: int, size: int) -> None:
        """``cuMemHostRegister`` / ``hipHostRegister``: page-locks ``size`` bytes of the process's memory at
        ``address`` (books only: the bytes stay where they are). A range overlapping one registered already is
        refused (CUDA driver API reference, cuMemHostRegister: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED).

        A locked range is resident host memory the kernel cannot reclaim while it stays locked (CUDA driver
        API reference, cuMemHostRegister: "page-locks the memory range"; the pages are faulted in and pinned),
        so it is counted as host memory in use until unregistered (:meth:`host_alloc`): on one pool with the
        GPU (GB10, an APU) every locked byte is a byte the GPU's budget loses, which is why ComfyUI 0.39 turns
        pinning off on integrated GPUs. A lock the host cannot give fails as the driver's does (out of memory)."""
        if address <= 0 or size <= 0:
            raise SimError("invalid", f"cannot register {size} bytes at {address:#x}")
        for base, length in self.host_registered.items():
            if base < address + size and address < base + length:
                raise SimError("already_registered", f"[{address:#x}, +{size}) overlaps the range registered at "
                                                     f"{base:#x}")
        self.host_alloc(size)
        self.host_registered[address] = size

    @_locked
    def host_unregister(self, address: int) -> None:
        """``cuMemHostUnregister`` / ``hipHostUnregister``: ``address`` must be the base a registration was made
        with (CUDA driver API reference, cuMemHostUnregister: else CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)."""
        size = self.host_registered.pop(address, None)
        if size is None:
            raise SimError("not_registered", f"no registration starts at {address:#x}")
        # the simulation cannot see the process's own mappings, so the lock stands for the resident pages it
        # pinned; they leave the books with it (ComfyUI unregisters a pin as its buffer is cut or closed, which
        # unmaps them)
        self.host_free(size)

    # ------------------------------------------------------------------ address space

    @_locked
    def quota_used(self) -> int:
        return self._reserved_total + self._mapped_total

    @_locked
    def address_reserve(self, size: int, alignment: int) -> int:
        self._granular(size, "reservation size")
        p = self.profile
        if p.address_quota is not None and self.quota_used() + size > p.address_quota:
            self.crashes += 1
            raise SimulatedCrash(f"access violation 0xC0000005: {size} more bytes of GPU address space past the "
                                 f"{p.address_quota} byte per-process quota")
        if p.churn_limit is not None and size >= p.churn_window and self.churn_frees >= p.churn_limit:
            raise SimError("oom", f"reserve failed after {self.churn_frees} reserve/free cycles of large windows")
        if self._reserved_total + size > self.va_space:  # the address space is full: out of memory (docstring)
            raise SimError("oom", f"address reserve of {size} bytes: {self._reserved_total} of the process's "
                                  f"{self.va_space} bytes of address space are reserved")
        align = max(alignment or 0, p.granularity)
        if self.memory.backed:
            try:
                base = self.memory.reserve(size, align)
            except MemoryCallFailed as exc:  # the process's address space is full: out of memory (docstring)
                if exc.errno in NO_FILES:
                    raise  # no descriptor left for the memory file: the caller's error names the limit
                raise SimError("oom", f"address reserve of {size} bytes: {exc}") from None
        else:
            base = -(-self._next_va // align) * align
            self._next_va = base + size
        self.reservations[base] = _Reservation(base, size, self.current)
        self._reserved_total += size
        if p.private_commit_reservations:
            self.private_commit += size
        return base

    @_locked
    def address_free(self, base: int, size: int) -> None:
        r = self.reservations.get(base)
        if r is None or r.size != size:
            raise SimError("invalid", f"no reservation of {size} bytes at {base:#x}")
        self._check_current(r.device, "the reservation")
        if self._overlapping(base, size):
            raise SimError("invalid", f"reservation at {base:#x} still has mappings")
        del self.reservations[base]
        self._reserved_total -= size
        for h in [h for h in self.held_released.values() if not h.ranges & self.reservations.keys()]:
            del self.held_released[h.id]  # its last range is freed: now the memory goes back (ROCm 7.2)
            self._give_back(h)
        if self.memory.backed:
            self.memory.unreserve(base, size)
        if self.profile.private_commit_reservations:
            self.private_commit -= size
        if self.profile.churn_limit is not None and size >= self.profile.churn_window:
            self.churn_frees += 1

    # ------------------------------------------------------------------ physical memory

    @_locked
    def create(self, size: int, device: int) -> int:
        self._granular(size, "allocation size")
        d = self._device(device)
        if not d.vmm:
            raise SimError("not_supported", f"device {device} does not support virtual memory management")
        self._check_current(device, "the allocation")
        self._take_descriptor()
        self._charge(d, size)
        offset = -1
        if self.memory.backed:
            try:
                offset = self.memory.create(size)
            except MemoryCallFailed as exc:
                if exc.errno in NO_FILES:
                    raise  # no descriptor left for the memory file: the caller's error names the limit
                raise SimError("oom", f"{size} bytes of device memory: {exc}") from None
        d.used += size
        h = _Handle(next(self._ids), device, size, offset=offset)
        self.handles[h.id] = h
        return h.id

    def descriptors_held(self) -> int:
        """The process's file descriptors the simulated runtime holds now: one per live handle where the
        profile's runtime holds one (ROCm 7.14 on Linux, see the module docstring), else none."""
        return len(self.handles) if self.profile.descriptor_per_handle else 0

    def _take_descriptor(self) -> None:
        """ROCm 7.14: a new handle needs a descriptor under the process's soft ``RLIMIT_NOFILE``; without one
        the call answers out of memory, as the runtime does (``SimError("oom")``, counted)."""
        if not self.profile.descriptor_per_handle:
            return
        limits, open_now = nofile_limits(), process_descriptors()
        soft = limits[0] if limits is not None else None
        if soft is None or open_now is None:
            return  # no limit, or nothing to count against it
        if open_now + self.descriptors_held() >= soft:
            self.descriptor_refusals += 1
            raise SimError("oom", f"EMFILE behind out of memory: {open_now + self.descriptors_held()} of "
                                  f"{soft} file descriptors open, one per live handle")

    def _charge(self, d: _Device, size: int) -> None:
        """Whether ``size`` more bytes fit on ``d`` (its VRAM; one pool: the host's available memory and the
        GTT; WDDM: past VRAM into shared system memory, counted as spilled); ``SimError("oom")`` if not.
        Takes what it needs of the page cache on one pool, as the kernel reclaims it before failing."""
        p = self.profile
        if p.unified:
            if self.meminfo()["MemAvailable"] < size:
                raise SimError("oom", f"{size} bytes past the unified pool")
            if p.gtt and d.used + size > p.gtt:  # an AMD APU's device memory is GTT, ttm.pages_limit bounds it
                raise SimError("oom", f"{size} bytes past the {p.gtt} byte GTT")
            take_cache = min(self.page_cache, max(0, size - self.meminfo()["MemFree"]))
            self.page_cache -= take_cache
        elif d.used + size > d.vram:
            if not p.wddm:
                raise SimError("oom", f"{size} bytes past {d.vram} bytes of VRAM")
            # WDDM sysmem fallback: the allocation succeeds in shared memory
            over = min(size, d.used + size - d.vram)
            if self.meminfo()["MemAvailable"] < over:
                raise SimError("oom", "shared system memory exhausted too")
            self.spilled_bytes += over

    # ------------------------------------------------------------------ the process's own allocations (sim only)

    @_locked
    def process_alloc(self, device: int, size: int) -> int:
        """The process allocates ``size`` bytes of device memory beside the VMM handles: what a real process
        holds besides membackend's pages (its CUDA or HIP context, its runtime allocator's blocks: torch's
        activations and cast buffers). Counted as the device's use wherever the driver reports it
        (mem-get-info, the unified pool, DXGI's usage, amdgpu's sysfs), so a budget sees it as a real
        driver would, and charged as ``cuMemCreate`` is (``SimError("oom")`` past the device's memory).
        Returns an id for :meth:`process_free`. Any size > 0 (no granularity: ``cudaMalloc`` has none)."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise SimError("invalid", f"a process allocation takes a size > 0 in bytes, got {size!r}")
        d = self._device(device)
        self._charge(d, size)
        d.used += size
        d.process += size
        alloc = next(self._ids)
        self.process_allocs[alloc] = (device, size)
        return alloc

    @_locked
    def process_free(self, alloc: int) -> None:
        """Free an allocation :meth:`process_alloc` made; ``SimError("invalid")`` for an unknown or freed id."""
        entry = self.process_allocs.pop(alloc, None)
        if entry is None:
            raise SimError("invalid", f"no process allocation {alloc}")
        device, size = entry
        d = self.devices[device]
        d.used -= size
        d.process -= size

    @_locked
    def process_bytes(self, device: int | None = None) -> int:
        """Bytes of the process's own allocations (:meth:`process_alloc`) on ``device``, or on every device."""
        return sum(d.process for d in self.devices if device is None or d.index == device)

    @_locked
    def release(self, handle: int) -> None:
        h = self.handles.get(handle)
        if h is None or h.released:
            raise SimError("invalid", f"no handle {handle}")
        self._check_current(h.device, "the handle")
        self._release_check({handle}, "cuMemRelease")
        h.released = True
        if not h.mapped_at:  # freed once released and unmapped (cuMemRelease docs)
            self._drop(h)

    @_locked
    def shed_memory(self) -> bool:
        """Close the process's device-memory file (its descriptor) now if nothing holds a range of it: no
        reservation, no handle, none released that ROCm 7.2 still holds. The next reservation or allocation
        opens a new one. Whether it was closed."""
        if not self.memory.backed or self.reservations or self.handles or self.held_released:
            return False
        return bool(self.memory.drop_file())

    def _drop(self, h: _Handle) -> None:
        del self.handles[h.id]
        if self.profile.memory_held_until_address_free and h.ranges & self.reservations.keys():
            self.held_released[h.id] = h  # ROCm 7.2: returned when its ranges are freed, not now
            return
        self._give_back(h)

    def _give_back(self, h: _Handle) -> None:
        self.devices[h.device].used -= h.size
        if h.offset >= 0:  # the memory is freed: released and no address maps it (cuMemRelease)
            self.memory.free(h.offset, h.size)

    @_locked
    def map(self, va: int, size: int, offset: int, handle: int) -> None:
        h = self.handles.get(handle)
        if h is None or h.released:
            raise SimError("invalid", f"no handle {handle}")
        if offset != 0 or size != h.size:
            raise SimError("invalid", "offset must be 0 and size the handle's size")
        self._check_current(h.device, "the handle")
        r = next((r for r in self.reservations.values() if r.base <= va and va + size <= r.base + r.size), None)
        if r is None:
            raise SimError("invalid", f"[{va:#x}, {va + size:#x}) is not inside a reservation")
        if self._overlapping(va, size):
            raise SimError("invalid", f"[{va:#x}, {va + size:#x}) is already mapped")
        p = self.profile
        if p.address_quota is not None and self.quota_used() + size > p.address_quota:
            self.crashes += 1
            raise SimulatedCrash("access violation 0xC0000005: mapping past the per-process GPU address quota")
        if h.offset >= 0:
            try:
                self.memory.map(va, size, h.offset)
            except MemoryCallFailed as exc:
                raise SimError("oom", f"mapping {size} bytes at {va:#x}: {exc}") from None
        below = p.map_fault_below
        self.mappings[va] = _Mapping(va, size, handle, h.device, trapped=bool(below and (va % below or size % below)))
        h.ranges.add(r.base)
        bisect.insort(self._starts, va)
        self._mapped_total += size
        h.mapped_at.add(va)
        if p.wddm:  # VidMm makes the allocation resident asynchronously
            self._queue(h.device, -1, p.pagein_seconds, frozenset({handle}), "page-in")

    @_locked
    def set_access(self, va: int, size: int, device: int) -> None:
        self._device(device)
        mappings = self._mappings_exact(va, size)
        for m in mappings:
            self._check_current(m.device, "the mapping")
        for m in mappings:
            if self.handles[m.handle].offset >= 0:
                self.memory.set_access(m.va, m.size)
            m.access = True

    @_locked
    def unmap(self, va: int, size: int) -> None:
        mappings = self._mappings_exact(va, size)
        for m in mappings:
            self._check_current(m.device, "the mapping")
        self._release_check({m.handle for m in mappings}, "cuMemUnmap")
        for m in mappings:
            if self.handles[m.handle].offset >= 0:
                self.memory.unmap(m.va, m.size)
            del self.mappings[m.va]
            del self._starts[bisect.bisect_left(self._starts, m.va)]
            self._mapped_total -= m.size
            h = self.handles[m.handle]
            h.mapped_at.discard(m.va)
            if h.released and not h.mapped_at:
                self._drop(h)

    def _mappings_exact(self, va: int, size: int) -> list[_Mapping]:
        """Whole mappings exactly covering the range: a sub-range is invalid (cuMemUnmap docs)."""
        found, pos = [], va
        while pos < va + size:
            m = self.mappings.get(pos)
            if m is None:
                raise SimError("invalid", f"{pos:#x} does not start a mapping")
            found.append(m)
            pos += m.size
        if pos != va + size:
            raise SimError("invalid", "the range ends inside a mapping")
        return found

    # ------------------------------------------------------------------ streams and events

    @_locked
    def stream_create(self) -> int:
        sid = next(self._ids)
        self.streams[sid] = self.current
        return sid

    def _stream_device(self, stream: int) -> int:
        if stream == 0:
            return self.current  # the legacy default stream of the current device
        if stream not in self.streams:
            raise SimError("invalid", f"no stream {stream}")
        return self.streams[stream]

    @_locked
    def stream_synchronize(self, stream: int) -> None:
        device = self._stream_device(stream)
        self._settle()
        self._complete([op for op in self.ops.values() if op.stream == stream and op.device == device])

    @_locked
    def device_synchronize(self) -> None:
        """Everything queued on the current device, the paging queue included, finishes."""
        self._settle()
        self._complete([op for op in self.ops.values() if op.device == self.current])

    @_locked
    def copy_async(self, dst: int, size: int, stream: int, src: int = 0) -> int:
        """Queue a host-to-device copy of ``size`` bytes from host address ``src``; its bytes arrive when
        the stream runs it. Books only: ``src`` may be 0 (a modelled copy)."""
        device = self._stream_device(stream)
        if self.memory.backed and not src:
            raise SimError("invalid", "the host source of a copy is NULL")
        handles = self._handles_in(dst, size, True, kind="illegal_address")
        op = self._queue(device, stream, size / self.profile.copy_bandwidth, handles, "copy")
        if self.memory.backed:
            op.copy = (dst, src, size)
        return op.id

    @_locked
    def copy_sync(self, dst: int, src: int, size: int, to_device: bool) -> None:
        """``cuMemcpyHtoD`` / ``cuMemcpyDtoH``: after the work queued before it (the legacy default
        stream synchronises with every stream of the device), the bytes move now. The device side must be
        mapped with access: ``..._ERROR_ILLEGAL_ADDRESS`` otherwise."""
        if not src or not dst:
            raise SimError("invalid", "a host or device pointer of the copy is NULL")
        device_side = dst if to_device else src
        self._handles_in(device_side, size, True, kind="illegal_address")
        self._settle()
        self._complete([op for op in self.ops.values() if op.device == self.current])
        if not self.memory.backed:
            raise SimError("not_supported", f"the simulated memory keeps books only ({self.memory.reason})")
        self.memory.copy(dst, src, size)

    @_locked
    def read(self, va: int, size: int) -> bytes:
        """Sim-only: the bytes a device range holds now (no wait for queued work); a range that is not
        mapped with access is ``illegal_address``, never read."""
        self._handles_in(va, size, True, kind="illegal_address")
        if not self.memory.backed:
            raise SimError("not_supported", f"the simulated memory keeps books only ({self.memory.reason})")
        self._settle()
        return self.memory.read(va, size)

    @_locked
    def event_create(self) -> int:
        eid = next(self._ids)
        self.events[eid] = None
        return eid

    @_locked
    def event_record(self, event: int, stream: int) -> None:
        if event not in self.events:
            raise SimError("invalid", f"no event {event}")
        device = self._stream_device(stream)
        self._settle()
        self.events[event] = (device, frozenset(op.id for op in self.ops.values()
                                                if op.stream == stream and op.device == device))

    @_locked
    def event_query(self, event: int) -> bool:
        if event not in self.events:
            raise SimError("invalid", f"no event {event}")
        self._settle()
        rec = self.events[event]
        return rec is None or not (rec[1] & self.ops.keys())

    @_locked
    def event_synchronize(self, event: int) -> None:
        if event not in self.events:
            raise SimError("invalid", f"no event {event}")
        rec = self.events[event]
        if rec is not None:
            self._settle()
            self._complete([self.ops[i] for i in rec[1] if i in self.ops])

    @_locked
    def event_destroy(self, event: int) -> None:
        if self.events.pop(event, "missing") == "missing":
            raise SimError("invalid", f"no event {event}")

    # ------------------------------------------------------------------ introspection (sim only)

    @_locked
    def state(self, device: int | None = None) -> dict[str, int]:
        """What the driver holds, for checking a ledger against: per device, or the whole process."""
        def pick(items, dev_of):
            return [x for x in items if device is None or dev_of(x) == device]

        return {
            "reserved": sum(r.size for r in pick(self.reservations.values(), lambda r: r.device)),
            "reservations": len(pick(self.reservations.values(), lambda r: r.device)),
            "mapped": sum(m.size for m in pick(self.mappings.values(), lambda m: m.device)),
            "handles": len(pick(self.handles.values(), lambda h: h.device)),
            "physical": sum(h.size for h in pick(self.handles.values(), lambda h: h.device)),
            "pending_ops": len(pick(self._pending_all(), lambda o: o.device)),
        }

    def _pending_all(self) -> list[_Op]:
        self._settle()
        return list(self.ops.values())
