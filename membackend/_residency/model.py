"""What the policy knows of a model: :class:`Model`, its :class:`ModelKind`, the checks of a registration,
and what a full unload did (:class:`Unloaded`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..types import Device, InvalidSize, ModelError, Reservation, WrongDevice
from .slots import Slot, as_int


class ModelKind(str, Enum):
    DIFFUSION = "diffusion"
    TEXT_ENCODER = "text_encoder"
    VAE = "vae"
    HOOK_DELEGATE = "hook_delegate"
    CAST_BUFFER = "cast_buffer"
    OTHER = "other"


@dataclass(eq=False)
class Model:
    """A registered model. Callers keep it; the manager keeps what it needs to know about it."""

    id: str
    size: int
    devices: tuple[Device, ...]
    kind: ModelKind = ModelKind.OTHER
    owner: "Model | None" = None
    owned: list["Model"] = field(default_factory=list, repr=False)
    last_used: int = 0
    slots: dict[Device, Slot] = field(default_factory=dict, repr=False)
    #: its owner dropped it and its tagged pages are kept as reclaimable cache (``ResidencyManager.cache``)
    cached: bool = False
    __weakref__: Any = field(default=None, init=False, repr=False, compare=False)

    def reservation(self, device: Device | str | None = None) -> Reservation | None:
        slot = self.slots[device if device.__class__ is Device else
                          Device.parse(device) if device is not None else self.devices[0]]
        r = slot.reservation
        return r if r is not None and not r.released else None


def new_model(model_id: Any, size: Any, devices: Any, kind: Any, owner: Model | None) -> Model:
    """A model as :meth:`~membackend.ResidencyManager.register` is asked for it, every argument checked (a
    typed error saying what is accepted), with one unbound slot per device; nothing is reserved yet."""
    if not isinstance(model_id, str) or not model_id:
        raise ModelError(f"a model id is a non-empty str, got {model_id!r}")
    size = as_int(size, "model size")
    if size <= 0:
        raise InvalidSize(f"model size must be > 0 bytes, got {size}")
    devs = tuple(Device.parse(d) for d in (devices if isinstance(devices, (list, tuple)) else [devices]))
    if not devs:
        raise WrongDevice(f"model {model_id!r} needs at least one device, got {devices!r}")
    if len(set(devs)) != len(devs):
        raise WrongDevice(f"model {model_id!r} names a device twice: {', '.join(map(str, devs))}; "
                          "accepted: each device once")
    try:
        kind = ModelKind(kind)
    except ValueError:
        raise ModelError(f"model kind {kind!r} is unknown; accepted: "
                         f"{', '.join(k.value for k in ModelKind)}") from None
    model = Model(model_id, size, devs, kind, owner)
    model.slots.update((d, Slot(model, d)) for d in devs)
    return model


@dataclass(frozen=True)
class Unloaded:
    """What one full unload did: ``bytes`` that were resident, the reservations that were ``alive`` before,
    how many were ``released`` (0 where the platform keeps address ranges), and their ``reserved_bytes``."""

    bytes: int
    alive: int
    released: int
    reserved_bytes: int
