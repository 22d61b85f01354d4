"""rocm_windows against the stock policy and the generic vmm on the simulated Windows ROCm machine.

    python benchmarks/bench_rocm_windows.py [--json] [--cycles N]

Everything runs in this one process on ``rocm-win-2gpu`` (2 x RX 9070 XT,
16 GiB each; reserved address space charged to private commit, ComfyUI
#15993; a 256 GiB per-process address quota that crashes when passed,
rocm-systems #9823; large reserves failing after 14 large frees,
rocm-systems #6191). Printed side by side:

* **seed**: a Krea2-sized set (UNet 12 GB, text encoder 5 GB, VAE 0.3 GB) on
  hip:0 with hip:1 visible; run text encoder -> UNet -> VAE, then unload
  everything. Private commit above the baseline after the unload and the
  reservations alive, for the stock policy (ComfyUI + comfy-aimdo: models
  sized as given, and as aimdo sizes a VBAR, ``model_size() * 10`` clamped to
  the card, aimdo #83) and for this plugin (membackend's policy).
* **cycles**: N load/run/unload cycles of the text encoder and the UNet,
  alternating hip:0 and hip:1, each model fully unloaded after its run:
  cycles completed, the first failure, large frees the driver counted, private
  commit after the cycles (first, last), peak address space in use against the
  enforced quota. Also the plugin unloading *everything* every cycle (which
  gives the kept windows back while the platform's large frees last).
* **per cycle** (``--per-cycle N``, default 20): the same cycles ending in
  ``unload_all``, printed cycle by cycle: private commit after the unload and
  the address windows the backend reports kept (``VmmBackend.kept_windows``,
  what ``membackend doctor`` shows), with the large frees the driver counted,
  for the plugin and for the generic vmm (which hits the churn defect).
* **quota**: 16 GiB reservations until refused: how many, whether the
  runtime crashed.

Only the plugin's entry point is used to find it, as membackend finds it.
"""

from __future__ import annotations

import json
import os
import sys

from membackend import ResidencyManager, create_session
from membackend.lab.simulated import StockManager, simulated_session
from membackend.platform import GENERIC

from workload_rocm_windows import HIP0, HIP1, KREA2, run_cycles

MiB, GiB = 1 << 20, 1 << 30
PROFILE = "rocm-win-2gpu"
VRAM = 16 * GiB
VBAR_PAGE = 32 * MiB


def session(backend: str | None):
    """``None``: what membackend selects on the profile (the plugin, through its entry point); ``"vmm"``: the
    generic backend with comfy-aimdo's 32 MiB pages, so both sides map the same pages."""
    if backend == "vmm":  # the generic platform's own knobs (no churn limit), not the profile's
        s = simulated_session(PROFILE, GENERIC, page_size=VBAR_PAGE)
    else:
        s = create_session(sim_profile=PROFILE)
    return s, s.backend.driver.sim


def aimdo_vbar(size: int) -> int:
    """comfy-aimdo's VBAR for ComfyUI's ``ModelVBAR(model_size() * 10)``: 32 MiB pages, clamped to the card."""
    return min(-(-size * 10 // VBAR_PAGE), VRAM // VBAR_PAGE) * VBAR_PAGE


def seed(backend: str | None, cls, sizing=lambda n: n) -> dict:
    s, sim = session(backend)
    baseline = sim.private_commit
    policy = cls(s)
    models = {n: policy.register(n, sizing(size), HIP0) for n, size in KREA2.items()}
    for name in ("text_encoder", "unet", "vae"):
        m = models[name]
        policy.use([m])
        assert policy.fault(m, 0, KREA2[name]).ok
        policy.unpin(m, 0, KREA2[name])
    reserved = sum(m.reservation(HIP0).size for m in models.values())
    policy.unload_all()
    out = {"backend": s.backend.name, "policy": policy.policy_name, "reserved": reserved,
           "commit_over_baseline": sim.private_commit - baseline,
           "reservations_alive": s.ledger.account(HIP0).reservations_alive,
           "driver_reservations": sim.state()["reservations"], "device1_reserved": sim.state(1)["reserved"]}
    del models
    s.close()
    return out


def cycles(backend: str | None, cls, n: int, unload_everything: bool = False) -> dict:
    s, sim = session(backend)
    manager = cls(s)
    r = run_cycles(s, manager, n, unload_everything)
    done, error, commits, peak = r.done, r.error, r.commits, r.peak_quota_used
    out = {"backend": s.backend.name, "policy": manager.policy_name, "unload": "unload_all" if unload_everything else
           "full_unload", "cycles": n, "done": done, "error": error, "large_frees": sim.churn_frees,
           "commit_each": commits, "kept_each": r.kept,
           "kept_report": [k.describe() for k in (kept(d) for d in (HIP0, HIP1)) if k is not None]
           if (kept := s.members.kept_windows) else [],
           "commit_first": commits[0] if commits else None, "commit_last": commits[-1] if commits else None,
           "commit_flat_after_2": None if error else len(set(commits[2:])) <= 1, "peak_quota_used": peak,
           "quota_limit": s.capabilities.address_quota, "crashes": sim.crashes}
    del r, manager  # the stock policy's models are collected here, after the figures are taken
    try:
        s.close()
    except Exception:  # the failed side may not close cleanly; its figures are already taken
        pass
    return out


def reserve_until_refused(backend: str | None) -> dict:
    s, sim = session(backend)
    kept, outcome = [], "never refused"
    try:
        for i in range(40):
            kept.append(s.reserve((HIP0, HIP1)[i % 2], 16 * GiB))
    except MemoryError as exc:  # AddressSpaceExhausted
        outcome = f"{type(exc).__name__}"
    except BaseException as exc:  # the simulated runtime's access violation (SimulatedCrash): the process died
        outcome = f"crash: {type(exc).__name__}"
    out = {"backend": s.backend.name, "windows": len(kept), "reserved": len(kept) * 16 * GiB, "outcome": outcome,
           "crashes": sim.crashes}
    if not sim.crashes:
        s.close()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[argv.index("--cycles") + 1]) if "--cycles" in argv else 200
    per = int(argv[argv.index("--per-cycle") + 1]) if "--per-cycle" in argv else 20
    for key in [k for k in os.environ if k.startswith("MEMBACKEND_")]:
        del os.environ[key]  # figures for the defaults
    results = {
        "seed": [seed("vmm", StockManager), seed("vmm", StockManager, aimdo_vbar), seed(None, ResidencyManager)],
        "cycles": [cycles("vmm", StockManager, n), cycles("vmm", ResidencyManager, n),
                   cycles(None, ResidencyManager, n), cycles(None, ResidencyManager, n, unload_everything=True)],
        "quota": [reserve_until_refused("vmm"), reserve_until_refused(None)],
        "per_cycle": [cycles(None, ResidencyManager, per, unload_everything=True),
                      cycles("vmm", ResidencyManager, per, unload_everything=True)],
    }
    results["seed"][1]["policy"] = "stock, aimdo VBAR sizing"
    if "--json" in argv:
        print(json.dumps(results, indent=2))
        return 0
    mib = lambda b: "-" if b is None else f"{b / MiB:,.0f} MiB"  # noqa: E731
    print(f"{PROFILE}: Krea2-sized set (UNet 12 GB, TE 5 GB, VAE 0.3 GB) on hip:0, hip:1 visible; run, unload_all")
    print(f"  {'backend':<13} {'policy':<25} {'reserved':>12} {'commit after unload':>20} {'alive':>6} {'driver':>7}")
    for r in results["seed"]:
        print(f"  {r['backend']:<13} {r['policy']:<25} {mib(r['reserved']):>12} "
              f"{'+' + mib(r['commit_over_baseline']):>20} {r['reservations_alive']:>6} {r['driver_reservations']:>7}")
    print(f"{n} load/run/unload cycles of TE + UNet alternating hip:0 / hip:1")
    print(f"  {'backend':<13} {'policy':<11} {'unload':<11} {'done':>5} {'large frees':>11} {'commit first':>13} "
          f"{'commit last':>12} {'flat':>5} {'peak VA':>12} {'quota':>12}  first failure")
    for r in results["cycles"]:
        flat = "-" if r["commit_flat_after_2"] is None else str(r["commit_flat_after_2"])
        print(f"  {r['backend']:<13} {r['policy']:<11} {r['unload']:<11} {r['done']:>5} {r['large_frees']:>11} "
              f"{mib(r['commit_first']):>13} {mib(r['commit_last']):>12} {flat:>5} "
              f"{mib(r['peak_quota_used']):>12} {mib(r['quota_limit']):>12}  {r['error'] or '-'}")
    print("16 GiB reservations alternating hip:0 / hip:1 until refused (runtime quota 256 GiB)")
    for r in results["quota"]:
        print(f"  {r['backend']:<13} {r['windows']:>3} windows ({mib(r['reserved'])}), then {r['outcome']}; "
              f"simulated crashes {r['crashes']}")
    plugin, control = results["per_cycle"]
    print(f"{per} load/run/unload_all cycles of TE + UNet alternating hip:0 / hip:1, after each: private commit "
          f"(GiB) and the windows {plugin['backend']} reports kept (GiB)")
    print(f"  {'cycle':>5}  {plugin['backend'] + ' commit':>20} {'kept':>7}  {control['backend'] + ' commit':>12}")
    gib = lambda b: "-" if b is None else f"{b / GiB:,.2f}"  # noqa: E731
    for i in range(per):
        at = lambda r, key: r[key][i] if i < len(r[key]) else None  # noqa: E731
        print(f"  {i + 1:>5}  {gib(at(plugin, 'commit_each')):>20} {gib(at(plugin, 'kept_each')):>7}  "
              f"{gib(at(control, 'commit_each')):>12}")
    for r in (plugin, control):
        print(f"  {r['backend']}: {r['done']} of {per} cycles, {r['large_frees']} large frees; "
              f"first failure: {r['error'] or '-'}")
    for line in plugin["kept_report"]:
        print(f"  kept: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
