"""The adapter's per-weight warm path: what ComfyUI's sampler pays membackend for each layer of each step.

    python benchmarks/bench_warm_path.py [--weights N] [--steps N] [--profile NAME]

ComfyUI's ``cast_modules_with_vbar`` calls, per layer and per step, ``vbar_fault``,
``vbar_signature_compare`` and (after the layer ran) ``vbar_unpin``; on a resident layer that is
all membackend adds to a warm prompt (SD1.5's UNet: about 700 layers x 20 steps). Measured here on
a simulated GPU, in one run, side by side (:func:`membackend.lab.adapter.warm_path`):

* **warm**: the adapter as it serves (a range that stayed resident is pinned again with no session call);
* **checked**: the same calls with the warm ranges dropped before each fault, so each one goes through
  the policy's checked path and the session, as every fault did before the warm ranges.

Prints microseconds per weight for both and their ratio (no threshold: this machine is shared and
noisy; the ratio is the figure). On a GPU the H200 check (``scripts/gpu-check --comfyui``) measures the
whole prompt against stock ComfyUI.
"""

from __future__ import annotations

import argparse

from membackend.lab.adapter import warm_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=int, default=700)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", default="h200")
    args = ap.parse_args(argv)
    figures = warm_path(args.weights, args.steps, args.profile)
    print(f"per weight (fault + compare + unpin) on simulated {args.profile}, {args.weights} weights x "
          f"{args.steps} steps:")
    print(f"  warm ranges   {figures['warm']:7.2f} us")
    print(f"  checked path  {figures['checked']:7.2f} us")
    print(f"  ratio         {figures['ratio']:7.2f}x")


if __name__ == "__main__":
    main()
