"""The adapter under contention, as ComfyUI's threads drive it: 8 threads faulting, writing and unpinning
layers of their own models through the facade while one thread runs the free-memory and full-unload paths
and one records fence tokens (some of whose copies fail).

No pinned layer is released under its pin (on the host backend that write would be SIGSEGV: the run is a
child process, so a crash is a failed test, not a dead suite), no untyped error reaches a thread and the
adapter never switches itself off, the ledger equals the kernel's view, and a full unload at the end leaves
zero reservations. The run lasts until every kind of work happened often enough (a few seconds here; capped
at two minutes on a slow machine) and is bounded in memory (host capacity 64 MiB). A copy that failed on one
model makes another model's fault try again (then answer out of memory), never switch the adapter off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("comfy_aimdo")
pytest.importorskip("torch")

RACE = textwrap.dedent('''
    import json, random, sys, threading, time
    from concurrent.futures import Future
    import torch
    from membackend._comfyui import vbar as facade
    from membackend._drivers.host import resident_bytes
    from membackend._fences import FutureToken
    from membackend.types import MembackendError, Device
    import host_arming  # the tests folder is on PYTHONPATH

    SECONDS = float(sys.argv[1])
    PS = host_arming.PAGE
    rt = host_arming.arm(32, "race", started=True)

    stop = threading.Event()
    errors, counts = [], {"faults": 0, "oom": 0, "unloads": 0, "tokens": 0, "failed_tokens": 0, "shed": 0}
    lock = threading.Lock()
    vbars = [facade.ModelVBAR(6 * PS, 0) for _ in range(8)]

    def worker(i):
        v = vbars[i]
        layers = [v.alloc(PS // 2 + 4096 * k) for k in range(6)]
        rnd = random.Random(i)
        try:
            while not stop.is_set():
                alloc = rnd.choice(layers)
                sig = facade.vbar_fault(alloc)
                if sig is None:
                    with lock:
                        counts["oom"] += 1
                    continue
                t = facade.aimdo_to_tensor(alloc, "cpu")
                t.fill_(i + 1)  # writes into the pinned range: SIGSEGV if it was released under the pin
                if int(t[-1]) != i + 1 or int(t[0]) != i + 1:
                    raise AssertionError(f"thread {i}: a pinned layer lost its bytes")
                facade.vbar_unpin(alloc)
                with lock:
                    counts["faults"] += 1
        except Exception as exc:
            errors.append(f"worker {i}: {type(exc).__name__}: {exc}")

    def unloader():
        rnd = random.Random(99)
        try:
            while not stop.is_set():
                v = rnd.choice(vbars)
                if rnd.random() < 0.5:
                    v.free_memory(1e32)  # ComfyUI's partial unload: never a pinned page
                    with lock:
                        counts["shed"] += 1
                else:
                    rt.unload_vbar(v, "race")  # a full unload: now, or put off while pinned
                    with lock:
                        counts["unloads"] += 1
                if rnd.random() < 0.2:
                    facade.vbars_reset_watermark_limits()  # a quiescent point: the put-off unloads run
        except Exception as exc:
            errors.append(f"unloader: {type(exc).__name__}: {exc}")

    def recorder():
        rnd = random.Random(7)
        try:
            while not stop.is_set():
                v = rnd.choice(vbars)
                fut = Future()
                try:
                    rt.residency.record(v._model, FutureToken(fut), v._dev)
                except MembackendError:
                    pass  # fully unloaded meanwhile: a typed refusal, nothing kept
                time.sleep(0.001)
                if rnd.random() < 0.1:
                    fut.set_exception(OSError("copy failed"))
                    with lock:
                        counts["failed_tokens"] += 1
                else:
                    fut.set_result(None)
                with lock:
                    counts["tokens"] += 1
        except Exception as exc:
            errors.append(f"recorder: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=unloader), threading.Thread(target=recorder)]
    for t in threads:
        t.start()
    # runs until every kind of work happened often enough (not for a fixed time: a slow, shared machine gets
    # the same race, only slower), capped at SECONDS
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline and not errors and not (
            counts["faults"] >= 400 and counts["unloads"] >= 40 and counts["tokens"] >= 40
            and counts["failed_tokens"] >= 4):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(60)
    dev = Device("cpu", 0)
    live = rt.session.reservations()
    kernel = sum(resident_bytes(r.base, r.size) for r in live)
    ledger = rt.session.ledger.account(dev)
    same = ledger.resident == kernel
    for v in vbars:
        rt.unload_vbar(v, "end")
    facade.vbars_reset_watermark_limits()
    print(json.dumps({"errors": errors, "aborted": rt.aborted, "counts": counts, "ledger_equals_kernel": same,
                      "ledger": ledger.resident, "kernel": kernel, "alive_at_end": len(rt.session.reservations()),
                      "pending_at_end": len(rt.pending)}))
''')


def test_eight_faulting_threads_an_unloader_and_a_token_recorder_never_break_a_pin_or_the_adapter(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-c", RACE, "120"], capture_output=True, text=True, timeout=400, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, f"the race run died (rc {p.returncode}): {p.stderr[-3000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["aborted"] is None, out
    c = out["counts"]
    assert c["faults"] >= 400 and c["unloads"] >= 40 and c["tokens"] >= 40 and c["failed_tokens"] >= 4, c  # it ran
    assert out["ledger_equals_kernel"], out
    assert out["alive_at_end"] == 0 and out["pending_at_end"] == 0, out
