"""The unified_gb10 plugin against today's GB10, side by side on the simulated GB10 (ComfyUI #14519).

    python benchmarks/bench_unified_gb10.py [--json] [--compute-seconds S] [--load-bandwidth B]

Needs the plugin installed (``pip install --no-deps -e plugins/unified_gb10``;
``scripts/test`` does it). Both sides run the same workload on a fresh
``gb10-128gb`` machine each:

* **plugin**: the membackend policy (``ResidencyManager``) on the auto-selected
  backend, ``unified_gb10``;
* **stock**: today's ComfyUI + comfy-aimdo, i.e. the stock policy
  (``StockManager``: residency dropped on every workflow change) on the generic
  VMM (budget from the driver's mem-get-info), with the plugin's page size so
  bytes compare page for page.

Workflows are three categories of models: image (≈20 GB), video (≈45 GB),
audio (≈8 GB), each faulted layer by layer in 1 GiB steps. Bytes *loaded* are
what a run had to back anew (every newly backed page is loaded again). The
modelled time of a run is ``loaded / bandwidth + compute``: the bandwidth is the
profile's ``copy_bandwidth`` unless ``--load-bandwidth`` (bytes/s) says
otherwise, the compute time is fixed (default 9 s, the warm run of #14519,
which loads nothing).

Scenarios, each on a fresh machine:

1. warm image, video, audio, then image → video → image: the second image run;
2. warm the same, then video → audio → video: the second video run;
3. a pool that fits only two workflows (pinned host memory takes it down to
   image + video + 4 GB) running image → video → audio → image → video: bytes
   loaded, whole models evicted (least recently used first), out-of-memory
   results, driver refusals, and the lowest MemAvailable against the headroom.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from membackend.lab.simulated import StockManager

from workload_unified_gb10 import CUDA0, GB, Workload, gb10_session, stock_session

PROFILE = "gb10-128gb"
WARM_UP = ("image", "video", "audio")
SCENARIOS = {
    "image -> video -> image": (WARM_UP + ("image", "video", "image"), 5),  # (runs, index of the run reported)
    "video -> audio -> video": (WARM_UP + ("video", "audio", "video"), 5),
}
TWO_POOL = ("image", "video", "audio", "image", "video")


def side(name: str) -> Workload:
    """One policy on one fresh simulated GB10, with the workflows registered."""
    if name == "stock":
        return Workload(stock_session(), StockManager)
    session = gb10_session()
    if session.name != "unified_gb10":
        raise SystemExit(f"the auto-selected backend is {session.name!r}, not unified_gb10: "
                         "install it with pip install --no-deps -e plugins/unified_gb10")
    return Workload(session)


def two_workflow_pin() -> int:
    """Pinned host bytes that leave the plugin's usable budget at image + video + 4 GB: any two workflows
    fit, all three do not."""
    plugin = side("plugin")
    pinned = plugin.session.budget_query(CUDA0).usable - (plugin.size_of("image") + plugin.size_of("video") + 4 * GB)
    plugin.session.close()
    return pinned


def scenario(runs: tuple[str, ...], pinned: int = 0) -> dict:
    out = {}
    for name in ("stock", "plugin"):
        w = side(name)
        if pinned:  # pinned host memory draws from the one pool on both sides
            w.session.backend.driver.host_alloc_pinned(pinned)
        results = [asdict(r) for r in w.sequence(*runs)]
        out[name] = {"runs": results, "refusals": w.refusals.count, "lowest_available": w.lowest_available,
                     "headroom": w.session.budget_query(CUDA0).headroom, "pinned": pinned,
                     "bandwidth": w.sim.profile.copy_bandwidth}
        w.session.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compute-seconds", type=float, default=9.0)
    parser.add_argument("--load-bandwidth", type=float, default=None, help="bytes/s (default: the profile's)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    results = {title: scenario(runs) for title, (runs, _) in SCENARIOS.items()}
    results["two-workflow pool"] = scenario(TWO_POOL, pinned=two_workflow_pin())
    for title, sides in results.items():
        for side in sides.values():
            bw = args.load_bandwidth or side["bandwidth"]
            for r in side["runs"]:
                r["seconds"] = r["loaded"] / bw + args.compute_seconds
    if args.json:
        print(json.dumps(results, indent=2))
        return 0

    bw = args.load_bandwidth or results["two-workflow pool"]["plugin"]["bandwidth"]
    print(f"simulated {PROFILE}; modelled time = bytes loaded at {bw / 1e9:g} GB/s + {args.compute_seconds:g} s "
          "compute; warm-up: image, video, audio")
    print(f"{'scenario':<26} {'run':<16} {'stock loaded':>13} {'stock time':>11} {'plugin loaded':>14} "
          f"{'plugin time':>12}")
    for title, (runs, at) in SCENARIOS.items():
        s, p = results[title]["stock"]["runs"][at], results[title]["plugin"]["runs"][at]
        print(f"{title:<26} {'second ' + s['workflow']:<16} {s['loaded'] / GB:>10.2f} GB {s['seconds']:>9.2f} s "
              f"{p['loaded'] / GB:>11.2f} GB {p['seconds']:>10.2f} s")
    two = results["two-workflow pool"]
    pinned = two["plugin"]["pinned"]
    print(f"\ntwo-workflow pool ({pinned / GB:.1f} GB pinned host memory; plugin headroom "
          f"{two['plugin']['headroom'] / GB:.1f} GB): {' -> '.join(TWO_POOL)}")
    print(f"{'run':<8} {'stock loaded':>13} {'plugin loaded':>14}  plugin evicted (least recently used first)")
    for s, p in zip(two["stock"]["runs"], two["plugin"]["runs"]):
        print(f"{p['workflow']:<8} {s['loaded'] / GB:>10.2f} GB {p['loaded'] / GB:>11.2f} GB  "
              f"{', '.join(p['evicted']) or '-'}")
    for name in ("stock", "plugin"):
        side = two[name]
        total = sum(r["loaded"] for r in side["runs"])
        oom = sum(r["oom"] for r in side["runs"])
        print(f"{name:<7} total loaded {total / GB:7.2f} GB, out-of-memory results {oom}, driver refusals "
              f"{side['refusals']}, lowest MemAvailable {side['lowest_available'] / GB:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
