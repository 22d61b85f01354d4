"""Independent measures of the memory a budget describes, for the conformance kit.

A budget is a claim about the machine (``Budget.total``, ``Budget.free``);
the kit checks it against what the machine itself says, never against the
backend's bookkeeping:

* a ``cpu`` device: ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``: what
  can be allocated without swapping, proc(5)) and, inside a container, the
  memory cgroup's limit minus its non-reclaimable use (cgroup v2 ``memory.max``
  less ``memory.current`` less ``memory.stat``'s ``inactive_file``; v1
  ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` less
  ``total_inactive_file``), as ComfyUI budgets it;
* a simulated GPU (a backend over membackend's simulated driver, as every
  platform record is with a profile): the simulation's own figures. On a
  device that shares one pool with the host (``unified``: GB10, Jetson) that
  is the pool, ``MemTotal`` and ``MemAvailable`` of the simulated host, never
  the device view (which reports ``MemFree``, without the reclaimable page
  cache: ComfyUI #15285); elsewhere the device's memory minus what is made
  of it (under WDDM the DXGI budget is lower still: the ``cuda_wddm``
  plugin's own tests hold its budget to it).

A :class:`Truth` is ``(total, free_low, free_high, source)``: a budget's
``total`` may not exceed ``total``, its ``free`` must lie in
``[free_low, free_high]`` (``free_low`` is 0 where under-reporting is only
caution; on one pool under-reporting is the GB10 bug itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._hostmem import read_cgroup
from ..types import Budget, Device, format_size

__all__ = ["Truth", "host_truth", "simulated_truth", "budget_problems", "tolerance_for", "sized", "MEMINFO"]

MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class Truth:
    """What the machine says of a device's memory: a budget's total is at most ``total``, its free lies in
    ``[free_low, free_high]``; ``source`` names where the figures came from."""

    total: int
    free_low: int
    free_high: int
    source: str


def _meminfo() -> dict[str, int]:
    found = {}
    with open(MEMINFO) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return found


def host_truth() -> Truth | None:
    """This host's memory: ``MemTotal`` and ``MemAvailable``, each capped by the memory cgroup (None where
    ``/proc/meminfo`` cannot be read: not Linux)."""
    try:
        info = _meminfo()
    except OSError:
        return None
    total, free, source = info["MemTotal"], info["MemAvailable"], f"{MEMINFO} MemTotal, MemAvailable"
    cgroup = read_cgroup()
    if cgroup is not None and cgroup.limit is not None and cgroup.limit < total:  # one at or above RAM limits nothing
        # what the cgroup can reclaim (its inactive file cache) is free to it, as MemAvailable counts it, and as
        # ComfyUI budgets it: the limit less the non-reclaimable use
        total, free = cgroup.limit, min(free, cgroup.limit - cgroup.non_reclaimable)
        source += f", {cgroup.describe()}"
    return Truth(total, 0, max(0, free), source)


def simulated_truth(session: Any, device: Device) -> Truth | None:
    """The simulated driver's own figures for ``device`` when the session's backend runs over membackend's
    simulated driver (``backend.driver.sim``), else None: a third party's own driver has no independent
    figures the kit can read."""
    sim = getattr(getattr(session.backend, "driver", None), "sim", None)
    if sim is None or device.kind == "cpu":
        return None
    profile = sim.profile
    if profile.unified and profile.gtt:  # an AMD APU: the pool and its GTT both bound what the device gets
        return _apu_truth(sim, device)
    if profile.unified:
        info = sim.meminfo()
        total, free = info["MemTotal"], info["MemAvailable"]
        source = f"the simulated {profile.name} pool (MemTotal, MemAvailable of one pool with the host)"
        facts = getattr(session, "machine", None)
        caps = [facts.ram_total if facts is not None and "ram_total" in facts.overridden else None,
                getattr(facts, "cgroup_limit", None)]
        for cap in (c for c in caps if c is not None and c < total):  # a smaller machine, the same use
            total, free = cap, max(0, min(free, cap - (total - free)))
            source += f", {cap} bytes as the machine facts say"
        return Truth(total, free, free, source)
    state = sim.state(device.index)
    vram = profile.devices[device.index].vram
    return Truth(vram, 0, max(0, vram - state["physical"]), f"the simulated {profile.name} device memory")


#: the most an APU budget may keep back from the host's MemAvailable for the system (membackend's own reserve is
#: a 32nd of the RAM within 1-4 GiB)
APU_SYSTEM_RESERVE_MAX = 4 << 30


def _apu_truth(sim: Any, device: Device) -> Truth:
    """An AMD APU's pool (simulated): at most what both the GTT (with the carve-out) and the host's
    ``MemAvailable`` leave; at least what both the GTT and ``MemFree`` leave, less the system's reserve."""
    profile, info = sim.profile, sim.meminfo()
    room = profile.carveout + profile.gtt - sum(d.used for d in sim.devices)
    high = max(0, min(room, info["MemAvailable"]))
    low = max(0, min(room, info["MemFree"]) - APU_SYSTEM_RESERVE_MAX)
    return Truth(min(info["MemTotal"], profile.carveout + profile.gtt), low, high,
                 f"the simulated {profile.name} APU pool (carve-out + GTT {(profile.carveout + profile.gtt) >> 20} "
                 "MiB, MemFree and MemAvailable of one pool with the host)")


def sized(n: int | None) -> str:
    """A byte count in a check's message: in a person's units, with the exact bytes beside them past 1 KiB
    (``6.0 GiB (6,442,450,944 bytes)``) so a difference of a page is still seen."""
    if n is None:
        return "unknown"
    return format_size(n) if abs(n) < 1024 else f"{format_size(n)} ({n:,} bytes)"


def budget_problems(truth: Truth, budget: Budget, held: int = 0, tolerance: int = 0) -> list[str]:
    """What is wrong with ``budget`` against ``truth``, in words (empty: nothing). ``held``: bytes the driver
    says the backend keeps for reuse (free to the backend, made to the machine); ``tolerance``: bytes the
    machine may have moved by between the two readings."""
    problems = []
    if budget.total > truth.total + tolerance:
        problems.append(f"total={sized(budget.total)} but {truth.source} says {sized(truth.total)}")
    if budget.free > truth.free_high + held + tolerance:
        problems.append(f"free={sized(budget.free)} but {truth.source} says at most {sized(truth.free_high)}"
                        + (f" (+{sized(held)} the backend keeps for reuse)" if held else ""))
    if budget.free + tolerance < truth.free_low:
        problems.append(f"free={sized(budget.free)} but {truth.source} says {sized(truth.free_low)} (one pool: "
                        "what the host could reclaim counts)")
    return problems


def tolerance_for(truth: Truth, device: Device) -> int:
    """Bytes a budget may differ from ``truth`` by: a host's memory moves with every process between two
    readings (1% of it); a simulated driver's does not (0.1%, for rounding)."""
    return truth.total // 100 if device.kind == "cpu" else truth.total // 1000
