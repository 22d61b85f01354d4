"""What a check on a real GPU needs, with public names only (``benchmarks/bench_gpu.py``, ``scripts/gpu-check``).

Build a session on a real device from these and :class:`membackend.Session`::

    from membackend import Session
    from membackend.lab.real import cuda_driver, this_machine, vmm_backend

    driver = cuda_driver()
    session = Session(vmm_backend(driver, page_size=32 << 20), machine=this_machine())

The same calls take a simulated driver (:func:`membackend.lab.simulated.simulated_driver`),
which is how the check is tested on a machine without a GPU. Importing this module imports
neither a GPU binding, torch nor pytest: each function imports what it needs when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..platform import GENERIC, Platform
from ..types import Capabilities, ConfigError, Device, FenceToken, Machine

if TYPE_CHECKING:
    from .._backends.aimdo import AimdoBackend
    from .._backends.vmm import VmmBackend
    from .._drivers.gpu import GpuDriver

__all__ = ["this_machine", "cuda_driver", "vmm_backend", "aimdo_backend", "event_token", "tensor_at"]


def this_machine() -> Machine:
    """This machine's facts (OS, CPUs, RAM, cgroup limit, torch build, GPUs), discovered once per process
    through the real drivers without creating a GPU context; RAM figures read now. Never raises for a
    driver that is missing or fails: what it could not read is said in the facts' ``discovery`` lines."""
    from .._machine import gather_machine

    return gather_machine()


def cuda_driver() -> GpuDriver:
    """The wrapper of the real CUDA driver (cuda-python) that membackend's VMM backend runs on, not
    initialised yet (its ``init()`` runs ``cuInit``; a backend calls it on first use).

    Raises ``ImportError`` when cuda-python is not installed (``pip install membackend[cuda]``)."""
    from .._drivers.cuda import CudaDriver

    return CudaDriver()


def vmm_backend(driver: GpuDriver, platform: Platform | None = None, *, page_size: int | None = None,
                capabilities: Capabilities | None = None) -> VmmBackend:
    """The generic virtual-memory backend over ``driver`` (:func:`cuda_driver`, or a simulated driver), for
    ``membackend.Session(backend, machine=...)``.

    ``platform``: a :class:`~membackend.platform.Platform` (None: the generic
    one); ``page_size``: bytes per page, rounded up to the device's allocation
    granularity (None: the platform's); ``capabilities``: replaces the
    platform's knobs. The backend initialises the driver on first use, and
    never closes it: the caller who opened the driver owns it.

    Raises ``ConfigError`` for a ``driver`` without a vendor (no GPU driver
    wrapper), a platform of another vendor than the driver's, a ``platform``
    or ``capabilities`` of the wrong type, or a ``page_size`` that is not a
    positive int.
    """
    from .._backends.vmm import VmmBackend

    where = "vmm_backend"
    vendor = getattr(driver, "vendor", None)
    if vendor not in ("cuda", "hip"):
        raise ConfigError("driver", where, f"{driver!r} is no GPU driver wrapper (vendor {vendor!r})",
                          "cuda_driver(), or a simulated driver (membackend.lab.simulated.simulated_driver)")
    if platform is not None and not isinstance(platform, Platform):
        raise ConfigError("platform", where, f"{platform!r} is not a Platform",
                          "a membackend.platform.Platform, or None for the generic platform")
    if platform is not None and platform.vendor not in (None, vendor):
        raise ConfigError("platform", where, f"platform {platform.name!r} is for {platform.vendor}, the driver "
                                             f"is {vendor}", f"a platform for {vendor}, or None")
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise ConfigError("capabilities", where, f"{capabilities!r} is not a Capabilities",
                          "a membackend.types.Capabilities, or None for the platform's own")
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0):
        raise ConfigError("page_size", where, f"{page_size!r} is no page size", "an int > 0 (bytes), or None")
    return VmmBackend(platform or GENERIC, driver, page_size=page_size, capabilities=capabilities)


def aimdo_backend() -> AimdoBackend:
    """The ``aimdo`` backend: comfy-aimdo's own VBARs (32 MiB pages), the stock engine, for comparison.
    comfy-aimdo is imported on first use; without it the backend's probe says so and its verbs raise
    ``DriverError``."""
    from .._backends.aimdo import AimdoBackend

    return AimdoBackend()


def event_token(driver: GpuDriver, event: Any, device: int) -> FenceToken:
    """A fence token over ``event``, an event of ``driver`` (``driver.event_create()``) already recorded on
    a stream after work that touches a reservation on device index ``device``: ``Session.record`` it, and
    frees and releases of that reservation wait for the work (G2). The token destroys the event once waited
    for. Raises ``ConfigError`` for a ``device`` that is not an index >= 0."""
    from .._drivers.gpu import EventToken

    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ConfigError("device", "event_token", f"{device!r} is no device index", "an int >= 0")
    return EventToken(driver, event, device)


def tensor_at(address: int, nbytes: int, device: Device | str, dtype: Any = None) -> Any:
    """A torch tensor over ``nbytes`` at ``address`` on ``device`` (``"cuda:0"``): no copy, and no check that
    the bytes are backed, so the caller keeps them resident for the tensor's whole life. ``dtype``: torch's
    (default ``torch.uint8``); ``address`` must be aligned to its element size. Raises ``Misaligned``,
    ``InvalidSize`` (``nbytes`` <= 0 or not a whole number of elements), and ``TorchMissing`` (an
    ``ImportError``) without torch."""
    from .._tensors import tensor_at as _tensor_at

    return _tensor_at(address, nbytes, device, dtype)
