"""What the ComfyUI adapter adds to ComfyUI's start-up, as a ratio to ``python -c "import torch"``.

A thin wrapper over :func:`membackend.lab.bench.measure_startup_cost` (the measurement ``membackend bench``
runs, whose docstring says what each side measures); rounds alternate the sides and each keeps its
best round.
Target: ratio <= 0.15.
Usage: ``python benchmarks/bench_comfyui_startup.py [--rounds N] [--json] [--no-bytecode-cache]``.
"""

from __future__ import annotations

import argparse
import json
import sys

from membackend.lab.bench import format_startup, measure_startup_cost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="run the interpreters with this environment's bytecode settings as they are")
    a = ap.parse_args(argv)
    result = measure_startup_cost(a.rounds, bytecode_cache=not a.no_bytecode_cache)
    print(json.dumps(result) if a.json else format_startup(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
