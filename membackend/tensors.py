"""Torch tensors over byte ranges of reservations.

A reservation's pages hold a model's weights; these functions hand them to
torch without a copy:

* on ``cpu`` devices the tensor views the host backend's memory in this
  process (``torch.frombuffer`` over the range);
* on ``cuda`` / ``hip`` devices through ``__cuda_array_interface__`` (torch's
  ROCm build serves HIP memory under the ``cuda`` device type).

**Never a stale or unbacked read.** A tensor is only ever built over pages that
are resident at that moment: :func:`reservation_tensor` and :func:`model_tensor`
fault the range first (pages that were freed get new memory, zero-filled on the
host, and new generations, so the caller knows to copy again); a released
reservation is refused with ``ReservationReleased``; :func:`check_resident`
refuses a range the residency policy does not know to be resident with
:class:`NotResident`. A tensor stays valid while its pages stay resident:
:func:`model_tensor` pins them (the policy never evicts pinned pages) until the
caller unpins; freeing or releasing the range under a live tensor is the
caller's contract violation (on the host the pages become inaccessible, so a
read faults instead of returning old data).

torch is imported lazily: importing this module costs nothing when torch is
absent, and every function raises :class:`TorchMissing` then.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Sequence

from .residency import Model, ResidencyManager
from .types import Device, Fault, InvalidSize, MembackendError, Misaligned, Reservation, ReservationReleased

if TYPE_CHECKING:
    import torch

    from .session import Session

__all__ = ["TorchMissing", "NotResident", "torch_device", "tensor_at", "reservation_tensor", "model_tensor",
           "check_resident"]


class TorchMissing(MembackendError, ImportError):
    """torch is not installed; install membackend's ``torch`` extra."""


class NotResident(MembackendError, ValueError):
    """A tensor was asked for over pages that are not resident; fault them first."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise TorchMissing(f"membackend.tensors needs torch ({exc}); install membackend[torch]") from None
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
              shape: Sequence[int] | None = None) -> "torch.Tensor":
    """A tensor over ``nbytes`` at ``address`` on ``device``: no copy, no check of residency.

    The lowest layer: the caller guarantees the bytes are backed (the functions
    below do). ``address`` must be aligned to ``dtype``'s element size.
    """
    torch = _torch()
    dtype, shape = _shape(nbytes, dtype if dtype is not None else torch.uint8, shape, torch)
    item = torch.empty((), dtype=dtype).element_size()
    if address % item:
        raise Misaligned(f"address {address:#x} is not aligned to {dtype}'s {item} bytes")
    if nbytes <= 0:
        raise InvalidSize(f"nbytes must be > 0, got {nbytes}")
    d = Device.parse(device)
    if d.kind == "cpu":
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        flat = torch.frombuffer(raw, dtype=torch.uint8)  # keeps ``raw`` alive; shares its memory
    else:
        holder = type("_CudaRange", (), {})()
        holder.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                           "version": 3}
        flat = torch.as_tensor(holder, device=torch_device(d))
    return flat.view(dtype).view(shape)


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
    f = session.fault(reservation, offset, size)
    if not f.ok:
        return None, f
    return tensor_at(reservation.base + offset, size, reservation.device, dtype, shape), f


def model_tensor(manager: ResidencyManager, model: Model, offset: int, size: int, device: Any = None,
                 dtype: Any = None, shape: Sequence[int] | None = None) -> tuple["torch.Tensor | None", Fault]:
    """Fault and pin a range of ``model`` through the residency policy, then a tensor over it.

    The pages stay pinned (never evicted) until ``manager.unpin(model, offset, size)``.
    A model fully unloaded before is reserved again transparently (new generations).
    Returns ``(None, fault)`` when out of memory even after eviction.
    """
    f = manager.fault(model, offset, size, device)
    if not f.ok:
        return None, f
    r = model.reservation(device)
    if r is None:  # unloaded by another thread between the fault and here: refuse rather than read it
        raise NotResident(f"model {model.id!r} was unloaded while its tensor was being made; fault it again")
    return tensor_at(r.base + offset, size, r.device, dtype, shape), f


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
