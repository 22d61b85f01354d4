"""The ComfyUI #16246 seed, side by side: stock ComfyUI + comfy-aimdo against this plugin, on ``wddm-6gb``.

Used by this plugin's tests and by ``benchmarks/bench_cuda_wddm.py``; the
backend itself never imports it.

**The workload** (one seed): on the simulated 6 GB RTX 3050 under WDDM, an
LTX-video-sized model (20 GB) is staged layer by layer, then a Z-Image text
encoder (7.7 GB) and Lumina2 (11.7 GB) are loaded the same way, each one
evicting what came before, as the dynamic loader did in the report. Per
layer: fault its pages, copy the weights in (an asynchronous host-to-device
copy on a stream), let the host run ahead for a while (the kernels), unpin.
The seed draws the WDDM page-in latency, the copy bandwidth (so the copy
durations) and the time the host runs ahead after each layer. A fault that
finds no memory is streamed instead (ComfyUI's fallback), as is one that
raises a typed driver error. At the end everything is unloaded.

**Stock** (:func:`stock_session`): membackend's own model of stock ComfyUI +
comfy-aimdo 0.5.x (from ``membackend.lab.simulated``, shared with
``membackend replay``): :class:`AimdoStockVmm` (the VMM mechanism doing what
aimdo does on this path) under :class:`AimdoLoadManager` (evictions made by a fault skip the
device sync, as aimdo's ``vbars_free`` does while the prefetch's malloc graph
is sync-paused). It records no fence tokens: aimdo has none, it relies on
``cuCtxSynchronize``.

**Plugin** (:func:`plugin_session`): :class:`ResidencyManager` over the
``cuda_wddm`` platform's own backend; every copy records an event token.

A simulated bugcheck (the first of ``simulated_failures()``) would end the machine. By
default the stock side carries on past one so that its handle counts cover the
whole workload like the plugin's: the unsafe call is counted (the driver's own
``bugchecks`` counter), the device is synchronized and the call made again.
``carry_on=False`` lets it end the run instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from membackend import ResidencyManager, Session
from membackend.lab.simulated import (
    AimdoLoadManager,
    AimdoStockVmm,
    simulated_driver,
    simulated_failures,
    simulated_session,
)
from membackend.types import Device, MembackendError
from membackend_cuda_wddm import PLATFORM

__all__ = ["MODELS", "Timing", "timing_for", "AimdoStockVmm", "AimdoLoadManager", "stock_session",
           "plugin_session", "run_seed", "SeedResult", "PROFILE", "LAYER", "SIDES"]

MiB, GB = 1 << 20, 10**9
PROFILE = "wddm-6gb"
DEVICE = Device("cuda", 0)
#: the report's models (ComfyUI #16246): the staging evicted, then the two loaded after it
MODELS = (("ltx_video", 20 * GB), ("z_image_text_encoder", int(7.7 * GB)), ("lumina2", int(11.7 * GB)))
LAYER = 256 * MiB  # bytes faulted, copied and used at a time
SIDES = ("stock", "plugin")


@dataclass(frozen=True)
class Timing:
    """What one seed draws: WDDM page-in latency, host-to-device copy bandwidth, host run-ahead per layer."""

    pagein_seconds: float
    copy_bandwidth: float
    run_ahead: tuple[float, ...]  # seconds the host runs ahead after each layer, cycled

    def driver(self) -> Any:
        """A driver over a fresh simulated machine of :data:`PROFILE` with this seed's timing
        (``membackend.lab.simulated.simulated_driver``, a variant of the profile)."""
        return simulated_driver(PROFILE, hold_bytes=False,  # modelled copies: sizes and times, no bytes
                                pagein_seconds=self.pagein_seconds, copy_bandwidth=self.copy_bandwidth)


def timing_for(seed: int) -> Timing:
    """Page-in 1-40 ms (a 6 GB card's VidMm paging a 64 MiB allocation in), copies at 3-25 GB/s (a busy
    PCIe 3.0 x8 RTX 3050 up to PCIe 4.0 x16), the host 0-30 ms ahead after each layer."""
    rng = random.Random(seed)
    return Timing(rng.uniform(0.001, 0.040), rng.uniform(3e9, 25e9), tuple(rng.uniform(0.0, 0.030) for _ in range(64)))


# --------------------------------------------------------------------------- sessions


def stock_session(timing: Timing, page_size: int, carry_on: bool = True) -> Session:
    """A session over :class:`AimdoStockVmm` on a fresh simulated machine with the seed's timing."""
    stock = AimdoStockVmm(timing.driver(), page_size=page_size, carry_on=carry_on, budget_source="wddm")
    return simulated_session(PROFILE, backend=stock)


def plugin_session(timing: Timing, page_size: int) -> Session:
    """A session over the ``cuda_wddm`` platform's backend on a fresh simulated machine with the seed's timing."""
    return simulated_session(PROFILE, PLATFORM, driver=timing.driver(), page_size=page_size)


# --------------------------------------------------------------------------- one seed


@dataclass
class SeedResult:
    """One run's figures, read from the simulated driver (its counters and call counts)."""

    bugchecks: int = 0
    creates: int = 0
    releases: int = 0
    spilled: int = 0
    typed_errors: list[str] = field(default_factory=list)
    not_ready_injected: int = 0
    streamed_layers: int = 0
    loaded_bytes: int = 0
    ledger_matches_driver: bool = True
    mismatches: list[str] = field(default_factory=list)
    baseline_after_unload: bool = True


def _check_ledger(session: Session, policy: ResidencyManager, where: str, result: SeedResult) -> None:
    """The ledger, the policy's page map and the driver's own tables must agree."""
    acct = session.ledger.account(DEVICE)
    drv = session.inspect(DEVICE)
    mapped = sum(s["resident"] for s in policy.stats(DEVICE).values())
    if (acct.reserved, acct.resident) != (drv.reserved, drv.resident) or mapped != acct.resident:
        result.ledger_matches_driver = False
        result.mismatches.append(f"{where}: ledger reserved {acct.reserved} resident {acct.resident}, driver "
                                 f"reserved {drv.reserved} resident {drv.resident}, policy resident {mapped}")


def run_seed(seed: int, side: str, *, page_size: int = PLATFORM.page_size, not_ready: float = 0.0,
             carry_on: bool = True) -> SeedResult:
    """Run the workload once on ``side`` with seed ``seed``: ``"stock"`` or ``"plugin"``.

    ``not_ready``: probability that each ``cuMemMap`` and ``cuMemSetAccess``
    answers ``CUDA_ERROR_NOT_READY`` (as after a forced eviction, aimdo #100).
    A typed membackend error from a fault is noted and the layer streamed; the
    ledger is compared with the driver after every model and after the unload.
    Anything else (a simulated bugcheck with ``carry_on=False`` included) propagates.
    """
    if side not in SIDES:
        raise ValueError(f"side {side!r}; accepted: {', '.join(SIDES)}")
    timing = timing_for(seed)
    if side == "stock":
        session = stock_session(timing, page_size, carry_on)
        policy: ResidencyManager = AimdoLoadManager(session)
    else:
        session = plugin_session(timing, page_size)
        policy = ResidencyManager(session)
    backend = session.backend
    driver = backend.driver
    sim = driver.sim
    if not_ready:
        sim.faults.rng.seed(seed)
        for call in ("cuMemMap", "cuMemSetAccess"):  # the driver's own CUDA_ERROR_NOT_READY code
            sim.faults.add(call, driver.NOT_READY, probability=not_ready)
    result = SeedResult()
    stream = driver.stream_create()
    try:
        models = [policy.register(name, size, DEVICE) for name, size in MODELS]
        step = 0
        for model in models:
            policy.use([model])
            for offset in range(0, model.size, LAYER):
                size = min(LAYER, model.size - offset)
                try:
                    f = policy.fault(model, offset, size)
                except MembackendError as exc:  # typed: ComfyUI streams the layer instead
                    result.typed_errors.append(f"{type(exc).__name__}: {exc}")
                    result.streamed_layers += 1
                    continue
                if not f.ok:
                    result.streamed_layers += 1
                    continue
                r = model.reservation(DEVICE)
                driver.memcpy_htod_async(r.base + offset, 0, size, stream)
                if side != "stock":  # the copy's event: frees of this reservation wait for it (G2)
                    policy.record(model, backend.fence_token(r, stream))
                result.loaded_bytes += size
                sim.advance(timing.run_ahead[step % len(timing.run_ahead)])
                step += 1
                policy.unpin(model, offset, size)
            _check_ledger(session, policy, f"after loading {model.id}", result)
        try:
            policy.unload_all()
        finally:
            _check_ledger(session, policy, "after unload_all", result)
        if side != "stock":
            # G1: the driver back at its baseline (stock keeps its reservations until the models are collected)
            drv = session.inspect(DEVICE)
            result.baseline_after_unload = (drv.resident, drv.held, sim.state(0)["handles"]) == (0, 0, 0)
    except simulated_failures()[0]:  # a simulated bugcheck (then a simulated crash)
        # the machine is gone; let nothing that runs afterwards (the stock models' finalizers) bugcheck again
        backend.carry_on = True
        driver.device_synchronize()
        raise
    del models, policy
    session.close()
    result.bugchecks = sim.bugchecks
    result.creates = sim.faults.calls.get("cuMemCreate", 0)
    result.releases = sim.faults.calls.get("cuMemRelease", 0)
    result.spilled = sim.spilled_bytes
    result.not_ready_injected = sim.faults.injected
    return result
