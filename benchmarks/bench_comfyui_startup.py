"""What the ComfyUI adapter adds to ComfyUI's start-up, as a ratio to ``python -c "import torch"``.

Each side runs in a fresh interpreter (imports are cached per process) and reports its own
``perf_counter`` time for the measured step only, so interpreter start-up is left out of both:

* ``torch``: ``import torch``;
* ``adapter, auto``: the prestartup script's work with this machine's own selection
  (on a machine without a GPU: the fallback, nothing patched);
* ``adapter, started``: prestartup with ``MEMBACKEND_BACKEND=host`` and then the
  ``init_devices`` hook starting membackend (session, facade), which is the most the
  adapter does before ComfyUI's first node. torch is imported between the two, as
  ComfyUI does, and that import is not counted.

Rounds alternate the three and each side keeps its best round. Target: ratio <= 0.15.
Usage: ``python benchmarks/bench_comfyui_startup.py [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TORCH = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
ADAPTER = """
import sys, time, types
sys.modules.setdefault("comfy.model_management", types.ModuleType("comfy.model_management"))
t0 = time.perf_counter()
from membackend.comfyui import startup
rt = startup.prestartup()
t1 = time.perf_counter()
import torch  # ComfyUI imports torch between the prestartup scripts and init_devices: not the adapter's cost
t2 = time.perf_counter()
if rt is not None:
    assert rt.init_devices([(0, 0)]), rt.aborted
print((t1 - t0) + (time.perf_counter() - t2))
if rt is not None:
    rt.stop()
"""


def _time(code: str, env: dict[str, str]) -> float:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(rounds: int) -> dict[str, float]:
    sides = {"torch": (TORCH, {}), "adapter, auto": (ADAPTER, {}),
             "adapter, started": (ADAPTER, {"MEMBACKEND_BACKEND": "host"})}
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):
        for name, (code, env) in sides.items():
            best[name] = min(best[name], _time(code, env))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    best = measure(a.rounds)
    rows = {name: {"seconds": s, "ratio": s / best["torch"]} for name, s in best.items()}
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"ComfyUI adapter start-up vs `import torch` (best of {a.rounds} rounds each, alternating)")
    print(f"{'side':<18} {'seconds':>9} {'ratio':>7}")
    for name, row in rows.items():
        print(f"{name:<18} {row['seconds']:>9.3f} {row['ratio']:>7.2f}")
    print("target: adapter ratio <= 0.15")
    return 0


if __name__ == "__main__":
    sys.exit(main())
