"""What the conformance kit needs around a backend: a session by name, a view of the
driver's real state to check the ledger against, injected driver failures, and
asynchronous work to fence.

A target is a string: a backend name (``host``, ``mybackend``) or, for a
backend that runs over a simulated driver, ``NAME:PROFILE`` (``vmm:wddm-6gb``).
"""

from __future__ import annotations

import errno
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from ..backends.host import HostBackend
from ..drivers import host as host_driver
from ..drivers.sim import PROFILES
from ..fences import FutureToken
from ..manager import BackendManager
from ..session import Session
from ..settings import load_settings
from ..types import Device, DriverError, FenceToken, Reservation

__all__ = ["Target", "parse_target", "runs_on_simulations", "build_session", "DriverView", "driver_view", "inject_failures",
           "async_work", "SIM_ERRORS"]

#: per simulated API: the calls the property tests fail at random, and with which code
SIM_ERRORS = {
    "cuda": {"cuMemCreate": 2, "cuMemMap": 719, "cuMemSetAccess": 600, "cuMemUnmap": 1, "cuMemRelease": 1,
             "cuMemAddressReserve": 2, "cuMemAddressFree": 1, "cuCtxSynchronize": 719},
    "hip": {"hipMemCreate": 2, "hipMemMap": 1, "hipMemSetAccess": 600, "hipMemUnmap": 1, "hipMemRelease": 1,
            "hipMemAddressReserve": 2, "hipMemAddressFree": 1, "hipDeviceSynchronize": 1},
}


@dataclass(frozen=True)
class Target:
    backend: str
    profile: str | None = None

    def __str__(self) -> str:
        return f"{self.backend}:{self.profile}" if self.profile else self.backend


def parse_target(text: str, profiles: list[str] | None = None, simulated: bool = True) -> list[Target]:
    """``vmm:h200`` → [vmm over h200]; ``vmm:all`` → one per profile; a bare name gets ``profiles``
    when its backend runs over a simulated driver (``simulated``), else stands alone."""
    name, _, profile = text.strip().partition(":")
    chosen = [profile] if profile else (list(profiles or []) if simulated else [])
    if "all" in chosen:
        chosen = list(PROFILES)
    return [Target(name, p) for p in chosen] if chosen else [Target(name)]


def runs_on_simulations(name: str) -> bool:
    """Whether the installed backend ``name`` honours ``sim_profile`` (the VMM backend and plugins on it)."""
    record = BackendManager(load_settings()).records.get(name)
    return bool(record and getattr(record.plugin, "honours_sim_profile", False))


def build_session(target: Target, *, sanitize: bool = False, **settings: Any) -> Session:
    """A session on exactly ``target`` (forced), as a user forcing it would get."""
    s = load_settings(backend=target.backend, sim_profile=target.profile, sanitize=sanitize, **settings)
    return BackendManager(s).session()


def kit_device(session: Session) -> Device:
    return session.devices()[0]


# --------------------------------------------------------------------------- the driver's view


@dataclass
class DriverView:
    """What the platform itself holds on a device: reserved and resident bytes."""

    reserved: int
    resident: int


def driver_view(session: Session, device: Device) -> DriverView | None:
    """Ask the driver, not the backend's bookkeeping; None where nothing can be asked.

    Backends that can (the VMM over a simulation) answer through ``driver_state``;
    the host backend is checked against the kernel: /proc/self/maps for the
    ranges and mincore(2) for resident pages.
    """
    backend = session.backend
    state = getattr(backend, "driver_state", None)
    if callable(state):
        answer = state(device)
        if answer is not None:
            return DriverView(answer["reserved"], answer["resident"])
    if isinstance(backend, HostBackend) and sys.platform.startswith("linux"):
        alive = [r for r in session.reservations() if r.device == device]
        return DriverView(sum(r.size for r in alive if host_driver.is_mapped(r.base)),
                          sum(host_driver.resident_bytes(r.base, r.size) for r in alive))
    return None


# --------------------------------------------------------------------------- fault injection


class _FlakyHostDriver:
    """Wraps a host driver; ``commit``/``populate``/``decommit`` fail at random like the kernel can."""

    def __init__(self, real: Any, probability: float, seed: int):
        self.real, self.p, self.rng, self.injected = real, probability, random.Random(seed), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _maybe(self, call: str, code: int) -> None:
        if self.rng.random() < self.p:
            self.injected += 1
            raise DriverError(code, call, "injected")

    def commit(self, addr: int, size: int) -> None:
        self._maybe("mprotect", errno.ENOMEM)
        self.real.commit(addr, size)

    def populate(self, addr: int, size: int) -> None:
        self._maybe("madvise(MADV_POPULATE_WRITE)", errno.ENOMEM)
        self.real.populate(addr, size)


@contextmanager
def inject_failures(session: Session, probability: float, seed: int = 0) -> Iterator[Any]:
    """Fail driver calls at random while inside; yields an object whose ``injected`` counts them.

    Simulated drivers fail their VMM calls (``SIM_ERRORS``); the host driver
    fails commits and populates with ENOMEM. Yields None where the backend's
    driver cannot be reached (a third-party backend).
    """
    backend = session.backend
    driver = getattr(backend, "_driver", None) or getattr(backend, "driver", None)
    sim = getattr(driver, "sim", None)
    if sim is not None:
        rules = [sim.faults.add(call, code, probability=probability)
                 for call, code in SIM_ERRORS[sim.profile.vendor].items()]
        sim.faults.rng.seed(seed)
        before = sim.faults.injected
        counter = type("Injected", (), {})()
        try:
            yield counter
        finally:
            counter.injected = sim.faults.injected - before
            for rule in rules:
                sim.faults.rules.remove(rule)
        return
    if isinstance(backend, HostBackend):
        flaky = _FlakyHostDriver(backend.driver, probability, seed)
        backend.driver = flaky
        try:
            yield flaky
        finally:
            backend.driver = flaky.real
        return
    yield None


# --------------------------------------------------------------------------- asynchronous work

_copies = ThreadPoolExecutor(2, thread_name_prefix="membackend-kit-copy")


def async_work(session: Session, r: Reservation, offset: int, size: int, seconds: float = 0.002) -> FenceToken:
    """Start asynchronous work on a resident range and return its fence token.

    On a simulated driver: a real async copy on a stream, fenced by an event.
    On the host: a thread that writes the range after a delay (it would crash
    the process if the range were freed under it). Elsewhere: a timer that
    touches nothing.
    """
    backend = session.backend
    driver = getattr(backend, "_driver", None)
    if driver is not None and getattr(driver, "sim", None) is not None:
        driver.set_device(r.device.index)
        stream = driver.stream_create()
        driver.memcpy_htod_async(r.base + offset, 0, size, stream)
        return backend.fence_token(r, stream)
    if isinstance(backend, HostBackend):
        import ctypes
        import time

        def copy() -> None:
            time.sleep(seconds)
            ctypes.memset(r.base + offset, 0x5A, size)
        return FutureToken(_copies.submit(copy))
    event = threading.Event()
    threading.Timer(seconds, event.set).start()

    class _Timer:
        def done(self) -> bool:
            return event.is_set()

        def wait(self) -> None:
            event.wait()
    return _Timer()
