"""The load/unload cycles of ComfyUI #15993 on the simulated Windows ROCm machine, shared by this
plugin's tests and ``benchmarks/bench_rocm_windows.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from membackend.types import Device, DriverError, MembackendError

HIP0, HIP1 = Device("hip", 0), Device("hip", 1)
#: a Krea2-sized set (bytes): the models of the #15993 report
KREA2 = {"text_encoder": 5 * 10**9, "unet": 12 * 10**9, "vae": 3 * 10**8}


@dataclass
class Cycles:
    """What a run of cycles did: cycles completed, private commit after each, the address windows the
    backend reports kept after each (both devices, from ``VmmBackend.kept_windows``; empty where the
    backend keeps none), the peak GPU address space in use, and the first failure (None when every
    cycle completed). ``models`` keeps the registered models alive: under the stock policy a model
    that is collected releases its reservation, so the caller decides when that happens."""

    done: int = 0
    commits: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    peak_quota_used: int = 0
    error: str | None = None
    models: dict = field(default_factory=dict, repr=False)


def run_cycles(session, policy, n: int, unload_everything: bool = False) -> Cycles:
    """``n`` load/run/unload cycles of the text encoder and the UNet under ``policy``, alternating hip:0 and
    hip:1; each cycle ends with a full unload of each model, or with ``unload_all`` (which also gives back
    the kept windows the platform allows). A driver error, a refused reservation (a typed out-of-memory)
    or an out-of-memory fault ends the run and is recorded."""
    sim = session.backend.driver.sim
    kept_windows = session.members.kept_windows
    models = {d: [policy.register(f"{k}@{d}", KREA2[k], d) for k in ("text_encoder", "unet")] for d in (HIP0, HIP1)}
    out = Cycles(models=models)
    for i in range(n):
        device = (HIP0, HIP1)[i % 2]
        try:
            for m in models[device]:
                policy.use([m])
                if not policy.fault(m, 0, m.size).ok:
                    raise RuntimeError(f"out of memory faulting {m.id}")
                out.peak_quota_used = max(out.peak_quota_used, sim.quota_used())
                policy.unpin(m, 0, m.size)
            if unload_everything:
                policy.unload_all()
            else:
                for m in models[device]:
                    policy.full_unload(m)
        except (DriverError, MembackendError, MemoryError, RuntimeError) as exc:
            out.error = f"cycle {i + 1}: {type(exc).__name__}: {exc}"
            break
        out.done += 1
        out.commits.append(sim.private_commit)
        reports = [kept_windows(d) for d in (HIP0, HIP1)] if kept_windows is not None else []
        out.kept.append(sum(k.bytes for k in reports if k is not None))
    return out
