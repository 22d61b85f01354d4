"""Torch tensors over byte ranges of reservations.

A reservation's pages hold a model's weights; these functions hand them to
torch without a copy:

* on ``cpu`` devices the tensor views the host backend's memory in this
  process (``torch.frombuffer`` over the range);
* on ``cuda`` / ``hip`` devices through ``__cuda_array_interface__`` (torch's
  ROCm build serves HIP memory under the ``cuda`` device type);
* where the backend says its device memory is memory of this process that the
  CPU addresses directly (``Session.tensor_device`` answers ``cpu``: a
  simulated GPU that holds its bytes), as a CPU tensor over those addresses.

**Never a stale or unbacked read.** A tensor is only ever built over pages that
are resident at that moment: :func:`reservation_tensor` and :func:`model_tensor`
fault the range first (pages that were freed get new memory, zero-filled on the
host, and new generations, so the caller knows to copy again); a released
reservation is refused with ``ReservationReleased``; :func:`check_resident`
refuses a range the residency policy does not know to be resident with
:class:`NotResident`.

**A tensor never outlives its pages.** Every tensor :func:`reservation_tensor`
and :func:`model_tensor` make is registered with the session as a live *view*
of its byte range (``Session.add_view``) -- :func:`reservation_tensor` before it
faults the range, :func:`model_tensor` right after its fault, under the residency
policy's lock, so no eviction comes between -- and the view ends when torch frees
the tensor's storage, that is when the tensor and every tensor sharing its memory (slices, ``.view()``, ``.numpy()``) are gone.
While a view lives:

* ``Session.free`` and ``Session.release_reservation`` of an overlapping range
  raise :class:`~membackend.types.TensorAlive` (naming the reservation, the
  range and how many tensors view it) and change nothing, so a full unload or a
  ``close`` waits for the caller to drop its tensors (``del t``);
* the residency policy's eviction skips the viewed pages as it skips pinned
  ones (:func:`model_tensor` also pins them until ``manager.unpin``), so memory
  pressure never takes pages from under a tensor;
* hence the address range cannot be released and handed to another model while
  a tensor over it exists: no read of freed or reused memory.

:func:`tensor_at` is the unchecked lowest layer: an address and a size, no
residency check, no view. The ComfyUI facade (``membackend._comfyui``) builds
ComfyUI's own tensors with it (after :func:`check_resident`): there ComfyUI's
pins (``vbar_fault`` … ``vbar_unpin``) govern the pages' lifetime, as they do
with comfy-aimdo; ComfyUI uses such a tensor between the fault and the unpin,
and the policy never frees a pinned page.

torch is imported lazily: importing this module costs nothing when torch is
absent, and every function raises :class:`TorchMissing` then.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from ._residency import Model, ResidencyManager
from .types import (
    Device,
    Fault,
    InvalidSize,
    Misaligned,
    NotResident,
    Reservation,
    ReservationReleased,
    TensorAlive,
    TorchMissing,
)

if TYPE_CHECKING:
    import torch

    from ._session import Session

__all__ = ["TorchMissing", "NotResident", "TensorAlive", "torch_device", "tensor_at", "reservation_tensor",
           "model_tensor", "check_resident"]


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise TorchMissing(f"membackend._tensors needs torch ({exc}); install membackend[torch]") from None
    return torch


def torch_device(device: Device | str) -> str:
    """The torch device string for a membackend device (``hip:N`` is ``cuda:N`` in torch's ROCm build)."""
    d = Device.parse(device)
    return "cpu" if d.kind == "cpu" else f"cuda:{d.index}"


def _shape(nbytes: int, dtype: Any, shape: Sequence[int] | None, torch: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(dtype, torch.dtype):
        raise InvalidSize(f"dtype must be a torch.dtype, got {dtype!r}")
    item = torch.empty((), dtype=dtype).element_size()
    if nbytes % item:
        raise InvalidSize(f"{nbytes} bytes are not a whole number of {dtype} elements ({item} bytes each)")
    count = nbytes // item
    if shape is None:
        return dtype, (count,)
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    if n != count or any(s < 0 for s in shape):
        raise InvalidSize(f"shape {shape} holds {n} elements, the range holds {count} of {dtype}; "
                          f"accepted: a shape whose product is {count}")
    return dtype, shape


def tensor_at(address: int, nbytes: int, device: Device | str, dtype: Any = None,
              shape: Sequence[int] | None = None, where: str | None = None) -> "torch.Tensor":
    """A tensor over ``nbytes`` at ``address`` on ``device``: no copy, no check of residency.

    ``where`` is the torch device the bytes are read from (``Session.tensor_device``); by default the
    one ``device`` names (:func:`torch_device`).

    The lowest layer: the caller guarantees the bytes are backed for the tensor's
    whole life; nothing stops a free or release under it (the ComfyUI facade uses
    it, with ComfyUI's pins governing the pages). :func:`reservation_tensor` and
    :func:`model_tensor` add that guarantee. ``address`` must be aligned to
    ``dtype``'s element size.
    """
    return _tensor(address, nbytes, device, dtype, shape, where)[0]


def _tensor(address: int, nbytes: int, device: Device | str, dtype: Any = None,
            shape: Sequence[int] | None = None, where: str | None = None) -> tuple["torch.Tensor", Any]:
    """:func:`tensor_at`, and the object torch keeps alive exactly as long as the tensor's storage."""
    torch = _torch()
    dtype, shape = _shape(nbytes, dtype if dtype is not None else torch.uint8, shape, torch)
    item = torch.empty((), dtype=dtype).element_size()
    if address % item:
        raise Misaligned(f"address {address:#x} is not aligned to {dtype}'s {item} bytes")
    if nbytes <= 0:
        raise InvalidSize(f"nbytes must be > 0, got {nbytes}")
    d = Device.parse(device)
    holder: memoryview | _CudaRange
    if (where or torch_device(d)) == "cpu":
        # the storage holds the buffer export of ``holder`` (a memoryview, which takes weak references)
        # until it is freed; ``holder`` keeps ``raw`` alive; both share the reservation's memory
        holder = memoryview((ctypes.c_uint8 * nbytes).from_address(address))
        flat = torch.frombuffer(holder, dtype=torch.uint8)
    else:
        # torch parses the interface through numpy and keeps a reference to ``holder`` until the
        # storage is freed (torch/csrc/utils/tensor_numpy.cpp, tensor_from_cuda_array_interface)
        holder = _CudaRange({"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3})
        flat = torch.as_tensor(holder, device=torch_device(d))
    return flat.view(dtype).view(shape), holder


class _CudaRange:
    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, interface: dict[str, Any]):
        self.__cuda_array_interface__ = interface


def _viewed(r: Reservation, offset: int, size: int, dtype: Any,
            shape: Sequence[int] | None, drop: Any, where: str) -> "torch.Tensor":
    """A tensor over the range whose storage ends the view ``drop`` (from ``Session.add_view``)."""
    try:
        t, holder = _tensor(r.base + offset, size, r.device, dtype, shape, where)
        weakref.finalize(holder, drop)
    except BaseException:
        drop()
        raise
    return t


def _range(reservation: Reservation, offset: int, size: int) -> None:
    if reservation.released:
        raise ReservationReleased(f"reservation {reservation.id} on {reservation.device} was released; "
                                  "a tensor over it would read unmapped memory")
    for what, v in (("offset", offset), ("size", size)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidSize(f"{what} must be an int, got {v!r}")
    if size <= 0 or offset < 0 or offset + size > reservation.size:
        raise InvalidSize(f"range [{offset}, {offset + size}) is not inside reservation {reservation.id} of "
                          f"{reservation.size} bytes; accepted: 0 <= offset, 0 < size, offset + size <= "
                          f"{reservation.size}")


def reservation_tensor(session: "Session", reservation: Reservation, offset: int, size: int, dtype: Any = None,
                       shape: Sequence[int] | None = None) -> tuple["torch.Tensor | None", Fault]:
    """Fault ``[offset, offset+size)`` through ``session``, then a tensor over it.

    Returns ``(tensor, fault)``; on out of memory ``(None, fault)`` with
    ``fault.ok`` false and nothing changed. Compare ``fault.generations`` with
    the ones of the last copy: different generations mean the pages are new
    and the data must be copied again.
    """
    _range(reservation, offset, size)
    torch = _torch()
    _shape(size, dtype if dtype is not None else torch.uint8, shape, torch)  # a bad shape changes nothing
    # the view first: a free racing this call either comes before it (and the fault backs the pages
    # again) or after it (and is refused while the tensor lives)
    drop = session.add_view(reservation, offset, size)
    try:
        f = session.fault(reservation, offset, size)
    except BaseException:
        drop()
        raise
    if not f.ok:
        drop()
        return None, f
    return _viewed(reservation, offset, size, dtype, shape, drop, session.tensor_device(reservation.device)), f


def model_tensor(manager: ResidencyManager, model: Model, offset: int, size: int, device: Any = None,
                 dtype: Any = None, shape: Sequence[int] | None = None) -> tuple["torch.Tensor | None", Fault]:
    """Fault and pin a range of ``model`` through the residency policy, then a tensor over it.

    The pages stay pinned (never evicted) until ``manager.unpin(model, offset, size)``.
    A model fully unloaded before is reserved again transparently (new generations).
    Returns ``(None, fault)`` when out of memory even after eviction. After the
    unpin the pages still stay while the tensor lives (see the module docstring).
    """
    torch = _torch()
    _shape(size, dtype if dtype is not None else torch.uint8, shape, torch)
    with manager._lock:  # the fault, the view and the tensor are one step for the policy: no unload between
        f = manager.fault(model, offset, size, device)
        if not f.ok:
            return None, f
        r = model.reservation(device)
        if r is None:  # cannot happen under the lock; refuse rather than read an unbacked range
            raise NotResident(f"model {model.id!r} was unloaded while its tensor was being made; fault it again")
        try:
            drop = manager.session.add_view(r, offset, size)
            return _viewed(r, offset, size, dtype, shape, drop, manager.session.tensor_device(r.device)), f
        except BaseException:
            manager.unpin(model, offset, size, device)
            raise


def check_resident(manager: ResidencyManager, model: Model, offset: int, size: int, device: Any = None) -> Reservation:
    """The reservation of ``model`` when every page of the range is resident; else :class:`NotResident`."""
    state = manager.residency(model, device)
    r = model.reservation(device)
    if r is None or not state:
        raise NotResident(f"model {model.id!r} has no reservation on {device or model.devices[0]} "
                          "(fully unloaded); fault the range first")
    if offset < 0 or size <= 0 or offset + size > model.size:
        raise InvalidSize(f"range [{offset}, {offset + size}) is outside model {model.id!r} of {model.size} bytes")
    ps = r.page_size
    gone = [p for p in range(offset // ps, (offset + size - 1) // ps + 1) if not state[p] & 1]
    if gone:
        raise NotResident(f"pages {gone[0]}..{gone[-1]} of model {model.id!r} are not resident "
                          f"({len(gone)} page(s)); fault the range before making a tensor over it")
    return r
