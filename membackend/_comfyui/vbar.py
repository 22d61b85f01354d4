"""A drop-in for ``comfy_aimdo.model_vbar`` (0.6.0) backed by membackend's residency manager.

Every name, parameter and default of comfy-aimdo 0.6.0's ``ModelVBAR`` and of its
module functions is kept (a test compares them by introspection), so ComfyUI's
``ModelPatcherDynamic`` and cast path run unchanged. Underneath:

* a ``ModelVBAR`` is one model registered with the :class:`~membackend._residency.ResidencyManager`
  of the running adapter: its reservation comes from ``Session.reserve`` on the
  selected backend (``device`` is the torch device index; a backend serving
  only ``cpu`` gets ``cpu:0``);
* ``alloc`` is aimdo's 512-byte aligned bump allocator and returns the same
  ``(vbar, address, size)`` tuple. Addresses are relative to ``base_addr``,
  which stays fixed for the object's life: after a full unload released the
  reservation (G1) the next fault reserves again elsewhere, and the old tuples
  still name the same bytes;
* ``fault`` faults and pins through the policy and returns a *signature*: the
  reservation's id and the generation of every page touched. A page that got
  new memory has a new generation, so ``vbar_signature_compare`` with the
  signature of the last copy is false and the caller copies again (the stale
  weight / black image class of bug cannot happen). ``None`` means out of
  memory after eviction, as in aimdo;
* ``unpin`` also records a fence token for the copy (and the compute reading
  it) ComfyUI may still have queued on its streams (:mod:`.streams`), so a later
  free, eviction or full unload of the range waits for them (G2);
* ``prioritize``, ``deprioritize``, watermarks and ``free_memory``
  are the policy's (frees are fenced by the session, G2);
* ``vbar_fault`` / ``vbar_unpin`` / ``aimdo_to_tensor`` never let an exception
  reach ComfyUI (G6): the adapter switches itself off (every original
  restored), and from then on every fault answers ``None`` as comfy-aimdo does
  with no memory, so ComfyUI casts each weight from its own copy. When the
  tensor over freshly faulted pages cannot be made, the pages that fault
  pinned are unpinned at once (the next unload can release the reservation)
  and ``aimdo_to_tensor`` answers a scratch tensor of the same size on
  ComfyUI's device, which ComfyUI fills from its own copy and casts from;
  ComfyUI's own ``vbar_unpin`` of that range later changes nothing. A range
  that was not resident (a race, not a fault of membackend's) is answered
  the same way without switching off; each kind of error is logged once;
* ``vbars_analyze`` is the bytes eviction could give back now (unpinned
  resident pages) on the device;
* ``vbars_reset_watermark_limits`` is called by ComfyUI after every node: a
  quiescent point, where the adapter also runs the full unloads it had to put
  off because pages were still pinned.

Nothing here runs until the adapter started (:meth:`membackend._comfyui.runtime.Runtime.init_devices`);
before that, constructing a ``ModelVBAR`` raises ``RuntimeError`` as aimdo does
for a device it has not initialised. The running adapter is
:func:`membackend._comfyui.runtime.current`. ``pageout_callback`` is accepted and kept:
membackend never pages weights out to host memory, so it is never called.
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

from .._residency import ModelKind, WarmRange
from .._tensors import NotResident, check_resident, tensor_at
from ..types import DriverError, ReservationReleased
from .buffers import VRAMBuffer
from .buffers import tensor_of as buffer_tensor
from .runtime import current

log = logging.getLogger("membackend")

__all__ = ["ModelVBAR", "vbar_fault", "vbar_unpin", "vbar_signature_compare", "vbars_reset_watermark_limits",
           "vbars_analyze", "aimdo_to_tensor"]

ALIGN = 512
#: ComfyUI's vbar_fault and vbar_unpin calls in this process so far, for the status (issue 41's per-prompt figure:
#: the prompt worker makes them; two threads at once may lose a count)
CALLS = [0, 0]
FAULT_TRIES = 3  # a fault that met failed copies of other models' pages tries this often, then answers None


def _started() -> Any:
    """The adapter whose session is open (running, or switched off with models still served); else None."""
    rt = current()
    return rt if rt is not None and rt.residency is not None else None


class ModelVBAR:
    """One model's address range, as comfy-aimdo's ``ModelVBAR``; see the module docstring."""

    def __init__(self, size, device, pageout_callback=None):
        rt = _started()
        if rt is None:
            raise RuntimeError(f"device {device} is not initialized (membackend has not started)")
        self._rt = rt
        self._pageout_callback = pageout_callback
        self.device = device
        self.max_size = size
        self.offset = 0
        self._limit = 0  # free_memory never goes below this byte (set_watermark_limit)
        self._dev = rt.device_for(device)
        self._model = rt.residency.register(rt.new_id("vbar"), int(size), self._dev, ModelKind.DIFFUSION)
        self.base_addr = self._model.reservation(self._dev).base
        #: the torch device that reads this model's pages (``cpu`` where a simulated GPU holds its bytes)
        self._where = rt.session.tensor_device(self._dev)
        #: ranges unpinned already because their tensor could not be made: ComfyUI's unpin of each is a no-op
        self._unpinned: set[tuple[int, int]] = set()
        self._closed = False
        #: with MEMBACKEND_TRACE: when each freshly backed range was faulted, so its unpin can trace the copy
        self._copy_started: dict[tuple[int, int], float] = {}
        #: (alloc, size) -> the session views of the tensors made over it while pinned: no release of the range
        #: while one lives; each ends at the range's unpin (ComfyUI keeps the tensor after it, as ``_v_weight``,
        #: and reads it again only when a new fault's signature says the pages are the same)
        self._holds: dict[tuple[int, int], list[Any]] = {}
        #: alloc -> (its WarmRange, size, signature): the next faults of a range that stayed resident pin it
        #: again with no session call and answer the same signature (ComfyUI's sampler, per weight per step)
        self._warm: dict[int, tuple[WarmRange, int, Any]] = {}
        #: the model on ComfyUI's classic path (:class:`~.classic.Promotion`), or None: on the dynamic path
        self._promotion: Any = None
        rt.vbars.add(self)

    # -- aimdo's methods, same names and parameters

    def prioritize(self, malloc_async_clamp=None):
        self._rt.residency.prioritize(self._model)

    def deprioritize(self):
        self._rt.residency.deprioritize(self._model)

    def alloc(self, num_bytes):
        self.offset = (self.offset + ALIGN - 1) & ~(ALIGN - 1)
        if self.offset + num_bytes > self.max_size:
            raise MemoryError("VBAR OOM")
        alloc = self.base_addr + self.offset
        self.offset += num_bytes
        self._rt.weights[self._model.id] = self.offset  # the weights' bytes: what the status and the log show
        return (self, alloc, num_bytes)

    def fault(self, alloc, size):
        rt = self._rt
        if rt.aborted is not None:  # switched off: out of memory, as aimdo answers; ComfyUI casts its own copy
            return None
        if rt.pending:
            rt.cancel_put_off(self)  # used again: its put-off unload is cancelled
        model, dev = self._model, self._dev
        if size.__class__ is not int:
            size = int(size)
        warm = self._warm.get(alloc)
        if warm is not None and warm[1] == size and warm[0].pin() is not None:
            return warm[2]
        for attempt in range(FAULT_TRIES):
            try:
                f = rt.residency.fault(model, alloc - self.base_addr, size, dev)
            except DriverError as exc:
                # Recoverable, as in free_memory: making room fenced a copy recorded on another model's pages and
                # that copy failed (a failed token then counts as finished, so the next try can evict), or the
                # driver refused this fault (rolled back). Told once; after the last try the answer is "out of
                # memory" and ComfyUI casts this weight from its own copy. The adapter stays on.
                rt.report_once("making room for a fault", exc, "the fault tries again, then answers out of memory")
                continue
            if not f.ok:
                return None
            r = model.reservation(dev)
            if r is not None:
                break
            # a full unload on another thread (one that does not wait for pins: unload_all, stop) took the
            # reservation between the fault and here: fault again, which reserves anew, as any fresh fault
        else:
            return None  # unloaded (or failed copies fenced) under us: out of memory, ComfyUI casts its own copy
        if f.mapped and rt.residency.tracer is not None:  # new pages: the cast path copies the layer
            self._copy_started[(alloc, size)] = time.perf_counter()
        signature = array("Q", (r.id, *f.generations))
        ticket = rt.residency.warm_range(model, alloc - self.base_addr, size, dev, f)
        if ticket is not None:
            self._warm[alloc] = (ticket, size, signature)
        else:
            self._warm.pop(alloc, None)
        return signature

    def unpin(self, alloc, size):
        if size.__class__ is not int:
            size = int(size)
        if not (self._holds or self._unpinned or self._copy_started):
            warm = self._warm.get(alloc)
            if warm is not None and warm[1] == size and warm[0].unpin():  # the warm path (see fault)
                fences = self._rt.fences
                if fences is not None:
                    fences.after_unpin(self._model, self._dev, self._where)
                return
        ended = False
        if self._holds:
            holds = self._holds.get((alloc, size))
            ended = bool(holds)
            if holds:  # one tensor's hold on the range ends with one pin (before it: the unpin may run a release)
                holds.pop()()
                if not holds:
                    del self._holds[(alloc, size)]
        if self._unpinned and (alloc, size) in self._unpinned:
            self._unpinned.discard((alloc, size))  # unpinned when its tensor failed (see aimdo_to_tensor)
            return
        rt = self._rt
        started = self._copy_started.pop((alloc, size), None) if self._copy_started else None
        if started is not None:  # for replays: the host time from fault to unpin, the copy issued in between
            rt.residency.copied(self._model, alloc - self.base_addr, size, time.perf_counter() - started, self._dev)
        rt.residency.unpin(self._model, alloc - self.base_addr, size, self._dev)
        fences = rt.fences
        if fences is not None:  # the copy and the compute reading these pages may still be queued (G2)
            fences.after_unpin(self._model, self._dev, self._where)
        if ended and rt.stopping:  # a stop waited for this hold to end
            try:
                self._rt.finish_stop()
            except Exception as exc:  # noqa: BLE001 - the stop's close, not this unpin, failed
                log.warning("membackend: closing after the stop: %s: %s", type(exc).__name__, exc)

    def loaded_size(self):
        return self._rt.residency.stats(self._dev)[self._model.id]["resident"]

    def set_watermark_limit(self, size_bytes):
        self._limit = max(0, int(size_bytes))

    def set_watermark(self, size_bytes):
        self._rt.residency.set_watermark(self._model, max(0, int(size_bytes)), self._dev)

    def free_memory(self, size_bytes):
        amount = max(0, int(min(float(size_bytes), float(self.max_size) * 2)))  # ComfyUI passes 1e32 for "all"
        for attempt in range(2):
            try:
                return self._rt.residency.shed(self._model, amount, self._dev, floor=self._limit)
            except DriverError as exc:
                # a copy recorded on these pages failed: reported here, once; a failed token then counts as
                # finished (a token still running is kept and fenced again), so the next try can free
                log.warning("membackend: freeing %s waited for a copy that failed (%s)%s", self._model.id, exc,
                            "; trying again" if attempt == 0 else "; nothing freed this time")
        return 0

    def get_nr_pages(self):
        r = self._model.reservation(self._dev)
        ps = r.page_size if r is not None else self._rt.page_size(self._dev)
        return -(-int(self.max_size) // ps)

    def get_watermark(self):
        w = self._rt.residency.watermark(self._model, self._dev)
        return int(self.max_size) if w is None else w

    def get_residency(self):
        state = self._rt.residency.residency(self._model, self._dev)
        return state if state else [0] * self.get_nr_pages()

    def close(self):
        if not self._closed:
            self._closed = True
            holds, self._holds = self._holds, {}
            self._warm = {}
            for drop in (d for ds in holds.values() for d in ds):  # closed: no unpin comes, the holds end here
                drop()
            self._rt.close_vbar(self)

    def __del__(self):
        try:
            if not getattr(self, "_closed", True) and current() is self._rt:
                self.close()
        except Exception as exc:  # a finalizer must not raise
            log.debug("membackend: closing a collected ModelVBAR failed: %s", exc)

    # -- membackend's own

    def tensor(self, alloc: int, size: int, device: Any) -> Any:
        """The bytes of ``alloc`` as a uint8 tensor; refused (``NotResident``) unless resident now.

        The tensor holds its range until the range's unpin (a session view): no free or release of it
        (the adapter's stop, a session closed under it) proceeds while ComfyUI reads or copies into it;
        a full unload meanwhile waits for the unpin (the policy defers it)."""
        offset = alloc - self.base_addr
        session = self._rt.session
        r = check_resident(self._rt.residency, self._model, offset, size, self._dev)
        self._rt.residency.untag(self._model, offset, size, self._dev)  # ComfyUI writes into it next (a copy, a cast)
        drop = session.add_view(r, offset, size)  # ReservationReleased: released since the check
        try:
            t = tensor_at(r.base + offset, size, r.device, where=self._where)
        except BaseException:
            drop()
            raise
        self._holds.setdefault((alloc, int(size)), []).append(drop)
        return t

    def tensor_failed(self, alloc: int, size: int, device: Any, exc: Exception) -> Any:
        """``aimdo_to_tensor`` could not make the tensor over a faulted range (G6): unpin the range now,
        report once (switching the adapter off unless the range merely was not resident), and answer a
        scratch tensor of ``size`` bytes on ``device`` for ComfyUI to copy its weights into. A range that
        was not resident was not pinned by a fault either (pinned pages are never evicted): nothing is
        unpinned then, so no other layer's pin on a shared page is taken."""
        import torch

        rt = self._rt
        if isinstance(exc, (NotResident, ReservationReleased)):  # released or evicted under us: a race
            rt.report_once("aimdo_to_tensor", exc, "ComfyUI casts that weight from its own copy")
        else:
            try:
                rt.residency.unpin(self._model, alloc - self.base_addr, int(size), self._dev)
                self._unpinned.add((alloc, int(size)))
            except Exception as unpin_exc:  # noqa: BLE001 - reported with the cause below
                log.debug("membackend: unpinning after a failed tensor: %s", unpin_exc)
            rt.abort(exc, "aimdo_to_tensor")
        return torch.empty(int(size), dtype=torch.uint8, device=device)


def vbar_fault(alloc):
    vbar, offset, size = alloc
    try:
        CALLS[0] += 1
        return vbar.fault(offset, size)
    except Exception as exc:  # G6: answer "out of memory": ComfyUI then casts from its own copy
        _abort(vbar, exc, "vbar_fault")
        return None


def vbar_unpin(alloc):
    if alloc is not None:
        vbar, offset, size = alloc
        try:
            CALLS[1] += 1
            vbar.unpin(offset, size)
        except Exception as exc:  # G6: an unpin that fails leaves a page pinned, never a crash
            _abort(vbar, exc, "vbar_unpin")


def _abort(vbar: Any, exc: Exception, where: str) -> None:
    rt = getattr(vbar, "_rt", None) or current()
    if rt is None:
        raise exc
    rt.abort(exc, where)


def vbar_signature_compare(a, b):
    if a is None or b is None:
        return False
    if len(a) != len(b):
        raise ValueError(f"Signatures of mismatched length {len(a)} != {len(b)}")
    return memoryview(a) == memoryview(b)


def vbars_reset_watermark_limits():
    rt = _started()
    if rt is None:
        return
    for vbar in list(rt.vbars):
        vbar._limit = 0
    rt.quiescent()


def vbars_analyze(device=None):
    rt = _started()
    if rt is None:
        return 0
    return rt.residency.evictable(rt.device_for(0 if device is None else device))


def aimdo_to_tensor(alloc, device):
    """``comfy_aimdo.torch.aimdo_to_tensor``: a uint8 tensor over an ``alloc`` tuple's bytes.

    Refuses (``NotResident``) bytes that are not resident now, so a tensor never reads
    freed memory. Allocations of comfy-aimdo's own ``ModelVBAR`` go to aimdo's function."""
    vbar, ptr, size = alloc
    if isinstance(vbar, VRAMBuffer):  # membackend's cast buffer
        return buffer_tensor(alloc)
    if not isinstance(vbar, ModelVBAR):  # an allocation of comfy-aimdo's own: its function answers
        return _original_to_tensor(alloc, device)
    try:
        return vbar.tensor(ptr, size, device)
    except Exception as exc:  # G6: never into ComfyUI's cast path
        return vbar.tensor_failed(ptr, size, device, exc)


def _original_to_tensor(alloc: Any, device: Any) -> Any:
    import comfy_aimdo.torch as ct

    fn = ct.aimdo_to_tensor
    if fn is aimdo_to_tensor:
        rt = current()
        fn = rt.patches.original(ct, "aimdo_to_tensor") if rt is not None else None
    if fn is None or fn is aimdo_to_tensor:
        raise RuntimeError("comfy-aimdo's aimdo_to_tensor is not available")
    return fn(alloc, device)

