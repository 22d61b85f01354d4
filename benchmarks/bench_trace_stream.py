"""Peak memory of ``membackend replay`` on a trace ten times longer: it streams, so memory stays flat.

    python benchmarks/bench_trace_stream.py                 # 10^4 and 10^5 events
    python benchmarks/bench_trace_stream.py --events 100000 # 10^5 and 10^6 events (about ten minutes)
    python benchmarks/bench_trace_stream.py --json

Writes two traces of the same workload (two models faulted, copied and unpinned layer by layer on the
simulated H200, a workflow switch every 20 runs, everything unloaded every 100), ``N`` and ``10 N`` events
long, then replays each, stock and plugin side by side as ``membackend replay`` does, in a fresh Python of
its own (so each peak resident set size, ``ru_maxrss``, is that replay's alone), through
``membackend.lab.bench.replay``. Printed: events, peak RSS and seconds per size, and the ratio of the peaks
(1.0: memory does not grow with the trace).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

GiB, LAYER = 1 << 30, 64 << 20
MODELS = {"unet": 8 * GiB, "text_encoder": 2 * GiB}

_REPLAY_ONE = """
import json, resource, sys, time
from membackend.lab.bench import replay
start = time.perf_counter()
comparison = replay(sys.argv[1])
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
print(json.dumps({"seconds": seconds, "peak_rss": peak, "violations": len(comparison.violations)}))
"""


def write_trace(path: Path, events: int) -> int:
    """A trace of about ``events`` workload events (header and closing unload included); returns the count."""
    written = 0
    with path.open("w") as f:
        def put(record: dict) -> None:
            nonlocal written
            f.write(json.dumps({"policy": "membackend", **record}) + "\n")
            written += 1

        f.write(json.dumps({"event": "trace", "format": "membackend-trace", "version": 1,
                            "sim_profile": "h200"}) + "\n")
        for model, size in MODELS.items():
            put({"event": "register", "model": model, "bytes": size, "devices": ["cuda:0"], "kind": "other"})
        run = 0
        while written < events:
            put({"event": "use", "models": list(MODELS), "workflow": f"wf{(run // 20) % 3}"})
            for model, size in MODELS.items():
                for offset in range(0, size, LAYER):
                    if written >= events:
                        break
                    span = {"model": model, "device": "cuda:0", "offset": offset, "bytes": LAYER}
                    put({"event": "fault", **span})
                    put({"event": "copy", **span, "seconds": 0.002})
                    put({"event": "compute", "seconds": 0.001})
                    put({"event": "unpin", **span})
            run += 1
            if run % 100 == 0:
                put({"event": "unload_all"})
        put({"event": "unload_all"})
    return written


def replay_peak(trace: Path) -> dict:
    """Replay ``trace`` in a fresh Python; its seconds, peak RSS in bytes and violation count."""
    proc = subprocess.run([sys.executable, "-c", _REPLAY_ONE, str(trace)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"replay of {trace} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(events: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sizes = []
        for n in (events, 10 * events):
            path = Path(tmp) / f"trace-{n}.jsonl"
            written = write_trace(path, n)
            sizes.append({"events": written, **replay_peak(path)})
    return {"sizes": sizes, "peak_ratio": sizes[1]["peak_rss"] / sizes[0]["peak_rss"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000, help="the shorter trace's events (default 10000)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.events < 10:
        parser.error("--events must be at least 10")
    result = run(args.events)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'events':>10} {'peak RSS':>12} {'seconds':>9}  violations")
    for s in result["sizes"]:
        print(f"{s['events']:>10,} {s['peak_rss'] / (1 << 20):>9.1f} MiB {s['seconds']:>9.1f}  {s['violations']}")
    print(f"peak RSS ratio for 10x the events: {result['peak_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
