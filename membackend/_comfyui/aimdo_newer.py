"""Drop-ins for the comfy-aimdo names newer than 0.4.13 that would reach aimdo's native code for a device
membackend serves, with no ComfyUI switch to keep them out.

Each has the parameters of comfy-aimdo's own (read from the 0.5.5 and 0.6.0 wheels' Python sources; a test
compares the signatures with every installed release), raises what aimdo raises for a bad argument, and is
patched over aimdo's name by :func:`install` (called from
:func:`membackend._comfyui.wiring.install_facade`) only where the installed comfy-aimdo has the name:

* ``comfy_aimdo.control.set_simple_vram_headroom(headroom)`` / ``get_simple_vram_headroom()`` (0.5.3+,
  ``comfy_aimdo/control.py``). aimdo's are one process-wide number in its native library, which the VBARs
  of aimdo's own devices obey; while membackend serves, none of ComfyUI's VBARs is aimdo's, so the number
  would change nothing. Custom nodes call them to make room around their own work (read the value, raise
  it, put it back), so here they are the headroom in force in membackend's session: the set is a live
  change of every served device's headroom (:meth:`.headroom.Headroom.set_live`, what the memory panel's
  *Keep free* field does: the next budget sees it, and what no longer fits is given back at once, never a
  pinned page), ``headroom`` plus ComfyUI's ``--vram-headroom`` per device (aimdo keeps that apart and
  adds it), capped at the device's total; the get answers that headroom on ComfyUI's device less the
  ``--vram-headroom`` part, so a get after a set answers the value set.
* ``comfy_aimdo.host_buffer.write_device_to_file(file_obj, file_offset, size, stream, device_ptr, device)``
  (0.6.0): aimdo's native writer stages device memory through a ring on ``device``, a device aimdo never
  initialised while membackend serves. Here the range is copied to host memory once the device has
  finished its queued work (aimdo waits for ``stream`` and for the file writes before it returns; a
  device-wide synchronisation covers ``stream``), then written at ``file_offset``.
* ``comfy_aimdo.host_buffer.write_host_to_file(file_obj, file_offset, size, host_ptr)`` (0.6.0): host
  memory to a file, no device involved; served with the device writer so that the whole file writer, like
  the reader (``read_file_to_device``, :mod:`.buffers`), never needs aimdo's library (not loaded at all
  where it failed to load: its ``lib`` is None, and aimdo's function fails on it).

File handles are aimdo's: an ``int`` is an OS file descriptor, anything else is asked for ``fileno()``. A
write that fails raises ``RuntimeError`` with aimdo's message, so ComfyUI's handling applies unchanged.
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
import os
from typing import Any

from .runtime import current

__all__ = ["set_simple_vram_headroom", "get_simple_vram_headroom", "write_device_to_file", "write_host_to_file",
           "NAMES", "install"]

#: (comfy-aimdo module, name) served by this module
NAMES = (("comfy_aimdo.control", "set_simple_vram_headroom"), ("comfy_aimdo.control", "get_simple_vram_headroom"),
         ("comfy_aimdo.host_buffer", "write_device_to_file"), ("comfy_aimdo.host_buffer", "write_host_to_file"))
MAX_SIMPLE_HEADROOM = 1 << 60  # comfy_aimdo/control.py, set_simple_vram_headroom: "between 0 and 2**60 bytes"
GIB = 1024 ** 3


def _running() -> Any:
    """The adapter whose session is open, as aimdo's ``lib`` is for its functions; else aimdo's error."""
    rt = current()
    if rt is None or rt.session is None or rt.residency is None or not rt.devices:
        raise RuntimeError("comfy-aimdo is not initialized")
    return rt


def _extra(rt: Any) -> int:
    """ComfyUI's ``--vram-headroom`` in bytes: what main.py passes to ``init_devices`` for every device."""
    gb = getattr(rt.comfy_args, "vram_headroom", None)
    return max(0, int(float(gb) * GIB)) if gb else 0


def set_simple_vram_headroom(headroom: int):
    """comfy-aimdo's ``control.set_simple_vram_headroom``: keep ``headroom`` bytes free (plus ComfyUI's
    ``--vram-headroom``) on every device membackend serves, from now on (a live change)."""
    headroom = int(headroom)
    if headroom < 0 or headroom > MAX_SIMPLE_HEADROOM:
        raise ValueError("simple_vram_headroom must be between 0 and 2**60 bytes")  # aimdo's words
    rt = _running()
    extra = _extra(rt)
    for dev in list(rt.devices):
        _, total = rt.headroom.bounds(dev)
        rt.headroom.set_live(dev, min(headroom + extra, total))


def get_simple_vram_headroom():
    """comfy-aimdo's ``control.get_simple_vram_headroom``: the headroom in force on ComfyUI's device (the
    first served), less ComfyUI's ``--vram-headroom``."""
    rt = _running()
    value, _ = rt.headroom.in_force(rt.devices[0])
    return max(0, int(value) - _extra(rt))


def _address(buf: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_from(file_obj: Any, view: memoryview, file_offset: int, what: str) -> None:
    """Write all of ``view`` to the file at ``file_offset`` (the file's own position is left as it was);
    aimdo's ``RuntimeError`` when it cannot."""
    try:
        fd = file_obj if isinstance(file_obj, int) else file_obj.fileno()
        done = 0
        if hasattr(os, "pwrite"):
            while done < len(view):
                done += os.pwrite(fd, view[done:], file_offset + done)
            return
        where = os.lseek(fd, 0, os.SEEK_CUR)  # Windows has no pwrite: seek, write, seek back
        try:
            os.lseek(fd, file_offset, os.SEEK_SET)
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.lseek(fd, where, os.SEEK_SET)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise RuntimeError(f"{what} failed ({exc})") from None


def write_host_to_file(file_obj, file_offset, size, host_ptr):
    """comfy-aimdo's ``host_buffer.write_host_to_file``: ``size`` bytes at ``host_ptr`` into the file at
    ``file_offset``; done on return."""
    size, file_offset = int(size), int(file_offset)
    if size < 0 or file_offset < 0:
        raise RuntimeError("xfer_file_write failed")
    if size:
        _write_from(file_obj, memoryview((ctypes.c_uint8 * size).from_address(int(host_ptr))).cast("B"),
                    file_offset, "xfer_file_write")


def write_device_to_file(file_obj, file_offset, size, stream, device_ptr, device):
    """comfy-aimdo's ``host_buffer.write_device_to_file``: ``size`` bytes of device memory at ``device_ptr``
    on ComfyUI's device index ``device`` into the file at ``file_offset``. The device's queued work
    (``stream``'s included) and the file write are finished on return."""
    from .._tensors import tensor_at

    size, file_offset = int(size), int(file_offset)
    if size < 0 or file_offset < 0:
        raise RuntimeError("hostbuf_file_writer_write failed")
    if size == 0:
        return
    rt = current()
    dev = rt.device_for(device) if rt is not None else "cpu:0"
    where = rt.session.tensor_device(dev) if rt is not None and rt.session is not None else None
    src = tensor_at(int(device_ptr), size, dev, where=where)
    if src.is_cuda:  # aimdo waits for ``stream`` first: every stream of the device covers it
        import torch

        torch.cuda.synchronize(src.device)
    bounce = mmap.mmap(-1, size)
    try:
        tensor_at(_address(bounce), size, "cpu:0").copy_(src)
        _write_from(file_obj, memoryview(bounce), file_offset, "hostbuf_file_writer_write")
    finally:
        try:
            bounce.close()
        except BufferError:  # a view still exported: the map goes with the last reference
            pass


def install(rt: Any) -> dict[str, tuple[Any, Any]]:
    """Patch these over comfy-aimdo's names where the installed release has them (surface patches, like the
    facade's: an abort leaves them for the models already served); ``{name: (aimdo's object, ours)}`` for
    the rebinding of names ComfyUI's modules imported."""
    done: dict[str, tuple[Any, Any]] = {}
    for modname, name in NAMES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            rt.patches.skipped.append(f"{modname}.{name}")
            continue
        ours = globals()[name]
        if rt.patches.replace(mod, name, ours, required=False, surface=True, label=f"{modname}.{name}"):
            done[name] = (rt.patches.original(mod, name), ours)
    return done
