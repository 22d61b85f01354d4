"""The ComfyUI #16246 seed, side by side over many seeds: stock ComfyUI + comfy-aimdo 0.5.x vs the cuda_wddm plugin.

    python benchmarks/bench_cuda_wddm.py [--seeds 1000] [--jobs N] [--not-ready 0.3] [--json]

On the simulated ``wddm-6gb`` machine (a 6 GB RTX 3050 under WDDM), each seed
draws a WDDM page-in latency, a copy bandwidth and the host's run-ahead per
layer, then stages a 20 GB LTX-video-sized model, evicts it while loading a
7.7 GB Z-Image text encoder, then 11.7 GB of Lumina2, and unloads everything
(``workload_cuda_wddm`` describes the workload and both sides).
Printed per side, summed over the seeds, all from the simulated driver:

* bugchecks: unmaps or releases while a page-in or a copy was pending (each
  one a bluescreen on the real machine), and the seeds that had at least one;
* physical handle creates and releases (``cuMemCreate`` / ``cuMemRelease`` calls);
* bytes spilled past VRAM into shared system memory (sysmem fallback);
* ledger = driver after every model and after the unload.

Sides: ``stock`` (StockManager over comfy-aimdo's mechanism) and ``plugin`` (the
ResidencyManager over the cuda_wddm backend). Then the plugin again with NOT_READY injected at random on ``cuMemMap`` and
``cuMemSetAccess``: every run completes or reports typed errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from workload_cuda_wddm import MODELS, SIDES, run_seed

MiB = 1 << 20


def _one(job: tuple[int, str, float]) -> dict:
    seed, side, not_ready = job
    r = run_seed(seed, side, not_ready=not_ready)
    return {"seed": seed, "side": side, "bugchecks": r.bugchecks, "creates": r.creates, "releases": r.releases,
            "spilled": r.spilled, "typed_errors": len(r.typed_errors), "not_ready_injected": r.not_ready_injected,
            "ledger_ok": r.ledger_matches_driver, "baseline": r.baseline_after_unload,
            "loaded": r.loaded_bytes, "streamed": r.streamed_layers}


def _sum(rows: list[dict]) -> dict:
    return {
        "seeds": len(rows),
        "bugchecks": sum(r["bugchecks"] for r in rows),
        "seeds_with_bugcheck": sum(1 for r in rows if r["bugchecks"]),
        "creates": sum(r["creates"] for r in rows),
        "releases": sum(r["releases"] for r in rows),
        "spilled_bytes": sum(r["spilled"] for r in rows),
        "typed_errors": sum(r["typed_errors"] for r in rows),
        "not_ready_injected": sum(r["not_ready_injected"] for r in rows),
        "ledger_mismatches": sum(1 for r in rows if not r["ledger_ok"]),
        "loaded_bytes": sum(r["loaded"] for r in rows),
        "streamed_layers": sum(r["streamed"] for r in rows),
    }


def measure(seeds: int, jobs: int, not_ready: float) -> dict:
    work = [(seed, side, 0.0) for side in SIDES for seed in range(seeds)]
    work += [(seed, "plugin", not_ready) for seed in range(seeds)]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_one, work, chunksize=8))
    else:
        rows = [_one(j) for j in work]
    clean, injected = rows[:len(SIDES) * seeds], rows[len(SIDES) * seeds:]
    result = {side: _sum([r for r in clean if r["side"] == side]) for side in SIDES}
    result[f"plugin, NOT_READY p={not_ready}"] = _sum(injected)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--not-ready", type=float, default=0.3, help="NOT_READY probability per map and set-access")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.seeds < 1 or args.jobs < 1 or not 0 < args.not_ready < 1:
        parser.error("--seeds and --jobs must be >= 1, --not-ready inside (0, 1)")
    result = measure(args.seeds, args.jobs, args.not_ready)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"wddm-6gb, {args.seeds} seeds: stage {', then '.join(f'{n} ({s / 1e9:.1f} GB)' for n, s in MODELS)}; "
          "sums over all seeds")
    print(f"{'side':<26} {'bugchecks':>9} {'seeds hit':>9} {'creates':>9} {'releases':>9} {'spilled':>11} "
          f"{'typed err':>9} {'NOT_READY':>9} {'ledger!=drv':>11}")
    for side, r in result.items():
        print(f"{side:<26} {r['bugchecks']:>9,} {r['seeds_with_bugcheck']:>9,} {r['creates']:>9,} "
              f"{r['releases']:>9,} {r['spilled_bytes'] / MiB:>7,.0f} MiB {r['typed_errors']:>9,} "
              f"{r['not_ready_injected']:>9,} {r['ledger_mismatches']:>11,}")
    stock = result["stock"]["creates"]
    for side in SIDES[1:]:
        print(f"creates, stock / {side}: {stock / max(1, result[side]['creates']):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
