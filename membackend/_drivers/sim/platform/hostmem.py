"""Host memory: host allocations, pinned (page-locked) buffers, registered ranges of the process's own memory,
and the process's own device allocations beside the VMM handles.

Where a behaviour comes from: the docstrings of :meth:`HostMemory.host_register` and
:meth:`HostMemory.host_unregister` (CUDA driver API reference, cuMemHostRegister / cuMemHostUnregister), and
the unified pool's accounting (``facts``: device pages and host copies share the pool, ComfyUI #15285).
"""

from __future__ import annotations

from typing import Callable

from ..memory import MemoryCallFailed
from .state import SimDevice, SimError, SimState, locked

__all__ = ["HostMemory"]


class HostMemory:
    """The host side of ``state``'s process: ``host_registered`` (base -> size) and ``process_allocs`` (id ->
    (device, bytes)). ``meminfo()`` and ``charge(device, size)`` are the facts', ``device(index)`` the
    contexts'."""

    def __init__(self, state: SimState, meminfo: Callable[[], dict[str, int]],
                 charge: Callable[[SimDevice, int], None], device: Callable[[int], SimDevice]):
        self.lock = state.lock
        self._state = state  # host_used, page_cache
        self._memory = state.memory
        self._devices = state.devices
        self._ids = state.ids
        self._meminfo = meminfo
        self._charge = charge
        self._device = device
        #: cuMemHostRegister / hipHostRegister: the page-locked ranges of the process's own memory, base -> size
        self.host_registered: dict[int, int] = {}
        #: the process's own device allocations beside the VMM handles (its context, its runtime allocator's
        #: blocks): id -> (device, bytes); see process_alloc
        self.process_allocs: dict[int, tuple[int, int]] = {}

    @locked
    def host_alloc(self, size: int) -> None:
        """Host memory (a pinned buffer, a host copy of weights); on unified memory it is the GPU pool."""
        state = self._state
        if self._meminfo()["MemAvailable"] < size:
            raise SimError("oom", f"host allocation of {size} bytes")
        take_cache = min(state.page_cache, max(0, size - self._meminfo()["MemFree"]))
        state.page_cache -= take_cache  # the kernel reclaims page cache before failing
        state.host_used += size

    @locked
    def host_free(self, size: int) -> None:
        self._state.host_used = max(0, self._state.host_used - size)

    @locked
    def pinned_alloc(self, size: int) -> int:
        """``cuMemAllocHost``: page-locked host memory, counted as :meth:`host_alloc`; its address (books
        only: the size stands in for it, there being no bytes)."""
        if not self._memory.backed:
            self.host_alloc(size)
            return size
        try:
            address = self._memory.host_alloc(size)
        except MemoryCallFailed as exc:
            raise SimError("oom", f"host allocation of {size} bytes: {exc}") from None
        try:
            self.host_alloc(size)
        except SimError:
            self._memory.host_free(address)
            raise
        return address

    @locked
    def pinned_free(self, address: int) -> None:
        """``cuMemFreeHost``."""
        if not self._memory.backed:
            self.host_free(address)
            return
        try:
            size = self._memory.host_free(address)
        except KeyError:
            raise SimError("invalid", f"{address:#x} is not memory cuMemAllocHost returned") from None
        self.host_free(size)

    @locked
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

    @locked
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

    # ------------------------------------------------------------------ the process's own allocations (sim only)

    @locked
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

    @locked
    def process_free(self, alloc: int) -> None:
        """Free an allocation :meth:`process_alloc` made; ``SimError("invalid")`` for an unknown or freed id."""
        entry = self.process_allocs.pop(alloc, None)
        if entry is None:
            raise SimError("invalid", f"no process allocation {alloc}")
        device, size = entry
        d = self._devices[device]
        d.used -= size
        d.process -= size

    @locked
    def process_bytes(self, device: int | None = None) -> int:
        """Bytes of the process's own allocations (:meth:`process_alloc`) on ``device``, or on every device."""
        return sum(d.process for d in self._devices if device is None or d.index == device)
