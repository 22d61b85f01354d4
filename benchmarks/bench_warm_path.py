"""The adapter's per-weight warm path: what ComfyUI's sampler pays membackend for each layer of each step.

    python benchmarks/bench_warm_path.py [--weights N] [--steps N] [--profile NAME]

ComfyUI's ``cast_modules_with_vbar`` calls, per layer and per step, ``vbar_fault``,
``vbar_signature_compare`` and (after the layer ran) ``vbar_unpin``; on a resident layer that is
all membackend adds to a warm prompt (SD1.5's UNet: about 700 layers x 20 steps). Measured here on
a simulated GPU, in one run, side by side:

* **warm**: the adapter as it serves (a range that stayed resident is pinned again with no session call);
* **checked**: the same calls with the warm ranges dropped before each fault, so each one goes through
  the policy's checked path and the session, as every fault did before the warm ranges.

Prints microseconds per weight for both and their ratio (no threshold: this machine is shared and
noisy; the ratio is the figure). On a GPU the H200 check (``scripts/gpu-check --comfyui``) measures the
whole prompt against stock ComfyUI.
"""

from __future__ import annotations

import argparse
import time

from membackend._comfyui import runtime as adapter
from membackend._comfyui import vbar as facade
from membackend._comfyui.runtime import Runtime
from membackend._drivers.open import machine_for
from membackend._manager import BackendManager
from membackend._settings import load_settings


def _runtime(profile: str) -> Runtime:
    settings = load_settings(sim_profile=profile, headroom=0)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    rt = Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None)
    rt.start([(0, 0)])
    rt.started = True
    adapter.decided("armed", "bench", "bench_warm_path", rt)
    return rt


def _steps(allocs: list, signatures: list, steps: int, vbar: facade.ModelVBAR | None) -> float:
    """Seconds for ``steps`` passes of fault + compare + unpin over ``allocs``; with ``vbar``, its warm
    ranges are dropped before each fault (the checked path)."""
    start = time.perf_counter()
    for _ in range(steps):
        for a, sig in zip(allocs, signatures):
            if vbar is not None:
                vbar._warm.clear()
            s = facade.vbar_fault(a)
            if not facade.vbar_signature_compare(s, sig):
                raise SystemExit("a warm layer's signature changed: the benchmark's pages were not resident")
            facade.vbar_unpin(a)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=int, default=700)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", default="h200")
    args = ap.parse_args(argv)
    rt = _runtime(args.profile)
    try:
        v = facade.ModelVBAR(1 << 30, 0)
        allocs = [v.alloc(600_000) for _ in range(args.weights)]
        signatures = []
        for a in allocs:  # the cold step: every layer faulted and copied once
            signatures.append(facade.vbar_fault(a))
            facade.vbar_unpin(a)
        figures = {}
        for _round in range(3):  # interleaved, best of three: the machine is shared
            for name, dropped in (("warm", None), ("checked", v)):
                t = _steps(allocs, signatures, args.steps, dropped) / (args.steps * len(allocs)) * 1e6
                figures[name] = min(figures.get(name, t), t)
        print(f"per weight (fault + compare + unpin) on simulated {args.profile}, {args.weights} weights x "
              f"{args.steps} steps:")
        print(f"  warm ranges   {figures['warm']:7.2f} us")
        print(f"  checked path  {figures['checked']:7.2f} us")
        print(f"  ratio         {figures['warm'] / figures['checked']:7.2f}x")
        v.close()
    finally:
        rt.stop()
        adapter.decided("stock", "bench over", "", None)


if __name__ == "__main__":
    main()
