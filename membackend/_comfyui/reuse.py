"""Weights already in VRAM are never read again (issue 41, item 2).

ComfyUI reads a weight from its file into its VBAR range with comfy-aimdo's ``HostBuffer.read_file_slice``
(through a pinned host slice) or ``read_file_to_device`` -- membackend's stand-ins for both call :class:`Reuse`.
A model ComfyUI dropped (its default cache drops an earlier workflow's models) is kept as *cache* where its
pages hold such bytes (``ResidencyManager.cache``), and when a new model reads the same bytes again -- the
checkpoint loaded anew after another model's workflow -- they are copied on the device from the cached pages
instead of read from the file, and the cached pages they filled go (the bytes moved to their new owner).

**Never stale.** A range is *tagged* with the bytes it holds only when they provably are a file's: membackend's
own read just wrote them, the range is a VBAR slot of a *plain* module -- no LoRA or other weight function
(ComfyUI's lowvram patch writes the patched weight into the range right after the read), and the VBAR holds
each weight in the dtype it is stored in (no cast) -- and the key names the file by its device, inode, size and
``mtime_ns``, the offset and length read, and the dtype. Every other way bytes reach a range drops its tags
first: ComfyUI asks for a tensor over a range (``aimdo_to_tensor``) before any copy or cast into it; any change
of a page's backing drops them in the residency manager. So a file rewritten (new ``mtime_ns``) or replaced (new
inode), another dtype, a patched weight or a page written by a cast is read anew.

The copy runs on ComfyUI's current stream and the cached pages are fenced by it before any is freed (G2).
``keep_dropped`` (``auto`` | ``off`` | a size) says how much may be kept: ``auto`` as the budget allows, ``off``
none, a size at most that per device; the cache goes before any page of a live model, and ``POST /free``
empties it.
"""

from __future__ import annotations

import bisect
import logging
import os
from typing import TYPE_CHECKING, Any

from .lines import say

if TYPE_CHECKING:
    from .links import RuntimeLinks

log = logging.getLogger("membackend")

__all__ = ["Reuse", "file_key"]


def file_key(file_obj: Any, file_offset: int, size: int) -> tuple[int, int, int, int, int, int] | None:
    """What names ``size`` bytes of an open file at ``file_offset``: ``(st_dev, st_ino, st_size, st_mtime_ns,
    offset, size)``; None where the file cannot be asked (then nothing is tagged or reused)."""
    try:
        fd = file_obj if isinstance(file_obj, int) else file_obj.fileno()
        st = os.fstat(fd)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, int(file_offset), int(size))


class Reuse:
    """The reads of one runtime that may come from VRAM instead of the file (see the module docstring);
    ``links``: what it reads of the runtime now."""

    def __init__(self, links: "RuntimeLinks", enabled: bool = True):
        self._links = links
        self.enabled = enabled
        #: bytes read from files into a served device, and bytes copied on the device instead
        self.from_file = 0
        self.from_vram = 0
        self._told = False

    # ------------------------------------------------------------------ which ranges hold plain weights

    def layout(self, patcher: Any, vbar: Any) -> None:
        """After ComfyUI's ``ModelPatcherDynamic.load``: the VBAR ranges of ``vbar`` whose modules are plain
        (no weight function, stored as they are computed), with their dtype; reads into anything else are
        never tagged or served."""
        module = getattr(patcher, "model", None)
        plain: list[tuple[int, int, str]] = []
        for m in (module.modules() if module is not None else ()):
            v = m.__dict__.get("_v")
            if not (isinstance(v, tuple) and len(v) == 3 and v[0] is vbar):
                continue
            dtype = _plain_dtype(m)
            if dtype is not None:
                plain.append((int(v[1]), int(v[1]) + int(v[2]), dtype))
        plain.sort()
        vbar._plain = ([start for start, _, _ in plain], plain)

    def _locate(self, device_ptr: int, size: int) -> tuple[Any, int, str] | None:
        """``(vbar, offset in its model, dtype)`` of a plain module's range holding ``[device_ptr,
        device_ptr+size)``; None for anything else (a cast buffer, a patched or cast module)."""
        for vbar in list(self._links.vbars):
            plain = getattr(vbar, "_plain", None)
            if not plain or vbar._closed:
                continue
            starts, entries = plain
            i = bisect.bisect_right(starts, device_ptr) - 1
            if i >= 0:
                start, end, dtype = entries[i]
                if device_ptr + size <= end:
                    return vbar, device_ptr - vbar.base_addr, dtype
        return None

    # ------------------------------------------------------------------ reads

    def read(self, file_obj: Any, file_offset: int, size: int, device_ptr: int, device: Any,
             host_address: int = 0) -> bool:
        """Serve a read of ``size`` bytes of ``file_obj`` at ``file_offset`` into ``device_ptr`` (and into host
        memory at ``host_address``, where not 0) from VRAM; True when it did (nothing to read), False when the
        caller reads the file (then :meth:`wrote`)."""
        residency = self._links.residency()
        if not self.enabled or residency is None or self._links.aborted() is not None or size <= 0:
            return False
        target = self._locate(device_ptr, size)
        key = file_key(file_obj, file_offset, size) if target is not None else None
        if target is None or key is None:
            return False
        vbar, offset, dtype = target
        dev = vbar._dev
        lent = residency.borrow(dev, (*key, dtype), avoid=(vbar._model, offset, size))
        if lent is None:
            return False
        from .._tensors import tensor_at

        moved = False
        try:
            source = tensor_at(lent.address, size, dev, where=vbar._where)
            tensor_at(device_ptr, size, dev, where=vbar._where).copy_(source)
            if host_address:
                tensor_at(host_address, size, "cpu:0").copy_(source)
            moved = True
        finally:
            fences = self._links.fences()
            if fences is not None:  # the copy may still be queued: a free of the source waits for it (G2)
                fences.fence_range(lent.reservation, vbar._where)
            residency.returned(lent, moved=moved)
        residency.tag(vbar._model, offset, size, dev, (*key, dtype))
        self.from_vram += size
        if not self._told:
            self._told = True
            say("weights already in VRAM are copied on the device, not read from their file again")
        return True

    def wrote(self, file_obj: Any, file_offset: int, size: int, device_ptr: int) -> None:
        """``size`` bytes of ``file_obj`` at ``file_offset`` were just read into ``device_ptr``: counted, and
        tagged where the range is a plain module's."""
        self.from_file += size
        residency = self._links.residency()
        if not self.enabled or residency is None or size <= 0:
            return
        target = self._locate(device_ptr, size)
        if target is None:
            return
        key = file_key(file_obj, file_offset, size)
        vbar, offset, dtype = target
        if key is not None:
            residency.tag(vbar._model, offset, size, vbar._dev, (*key, dtype))


def _plain_dtype(m: Any) -> str | None:
    """The dtype a plain module's VBAR range holds its weights in (both the same), else None: a weight function
    or lowvram patch applies, a weight is quantized, or the model computes in another dtype than it stores."""
    import torch

    d = m.__dict__
    dtype = None
    for name in ("weight", "bias"):
        if d.get(f"{name}_lowvram_function") is not None or d.get(f"{name}_function"):
            return None
        t = getattr(m, name, None)
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return None
        want = getattr(m, f"{name}_comfy_model_dtype", None) or getattr(t, "_model_dtype", None) or t.dtype
        if want != t.dtype or (dtype is not None and str(t.dtype) != dtype):
            return None
        dtype = str(t.dtype)
    return dtype
