"""Residency: the membackend policy against the stock (ComfyUI + comfy-aimdo) policy on the same workload.

    python benchmarks/bench_residency.py [--json]

For each simulated profile (and the host backend with a 256 MiB cap), models
of 35% of the usable memory run image → video → image → audio → image, then
everything is unloaded. Printed per policy, side by side:

* bytes copied to the device (every newly backed page must be copied again);
* reservations alive and reserved bytes after the full unload (G1);
* on rocm-win-2gpu, private commit after the unload (the 41.58 GB plateau of #15993);
* simulated transfer time of the copies at the profile's copy bandwidth, and its ratio.
"""

from __future__ import annotations

import json
import sys

from membackend import ResidencyManager, Session
from membackend.lab.simulated import StockManager, host_session, simulated_profiles, simulated_session
from membackend.types import Device

MiB = 1 << 20
#: each side's manager, by the name of its policy (``policy_name``)
SIDES = (("stock", StockManager), ("membackend", ResidencyManager))
WORKFLOW = ("image", "video", "image", "audio", "image")


def session_for(target: str) -> tuple[Session, Device, int, float]:
    if target == "host":
        return host_session(capacity=256 * MiB, headroom=16 * MiB), Device("cpu", 0), 2 * MiB, 0.0
    # the generic VMM backend with the profile's own knobs, on the profile's machine
    s = simulated_session(target, page_size=64 * MiB)
    profile = s.backend.driver.sim.profile
    return s, Device(profile.vendor, 0), 64 * MiB, profile.copy_bandwidth


def run(target: str, cls) -> dict:
    s, dev, page, bandwidth = session_for(target)
    policy = cls(s)
    assert (policy.policy_name, cls) in SIDES
    size = int(s.budget_query(dev).usable * 0.35) // page * page
    models = {n: policy.register(n, size, dev) for n in ("image", "video", "audio")}
    copied = oom = 0
    for name in WORKFLOW:
        m = models[name]
        policy.use([m])
        f = policy.fault(m, 0, m.size)
        policy.unpin(m, 0, m.size)
        copied += f.mapped
        oom += not f.ok  # out of memory: the model could not be made resident (ROCm 7.2 holds freed pages)
    policy.unload_all()
    acct = s.ledger.account(dev)
    sim = getattr(getattr(s.backend, "driver", None), "sim", None)  # None: the host backend's driver
    return {"copied": copied, "out_of_memory": oom, "copy_seconds": copied / bandwidth if bandwidth else None,
            "alive_after_unload": acct.reservations_alive, "reserved_after_unload": acct.reserved,
            "private_commit_after_unload": sim.private_commit if sim is not None else None, "model_bytes": size}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = {t: {name: run(t, cls) for name, cls in SIDES}
               for t in ["host", *simulated_profiles(vmm_only=True)]}
    if "--json" in argv:
        print(json.dumps(results, indent=2))
        return 0
    print(f"workflow {' -> '.join(WORKFLOW)}, models of 35% of usable memory each, then unload_all")
    print(f"{'target':<15} {'policy':<11} {'copied':>12} {'copy time':>10} {'alive':>6} {'reserved':>12} "
          f"{'commit':>12} {'oom':>4}  copied ratio stock/membackend")
    for target, pair in results.items():
        ratio = pair["stock"]["copied"] / max(1, pair["membackend"]["copied"])
        for name, r in pair.items():
            t = f"{r['copy_seconds']:.2f} s" if r["copy_seconds"] is not None else "-"
            commit = r["private_commit_after_unload"]
            c = f"{commit / MiB:,.0f} MiB" if commit is not None and target == "rocm-win-2gpu" else "-"
            tail = f"  {ratio:.2f}" if name == "membackend" else ""
            print(f"{target:<15} {name:<11} {r['copied'] / MiB:>8,.0f} MiB {t:>10} {r['alive_after_unload']:>6} "
                  f"{r['reserved_after_unload'] / MiB:>8,.0f} MiB {c:>12} {r['out_of_memory']:>4}" + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
