"""The ComfyUI adapter's per-call paths under the lab's timers, for ``benchmarks/``: each function
measures two ways of doing one thing in the same run, interleaved in rounds, each way keeping its
best round (the machines this runs on are shared and noisy), and returns the figures; no threshold.

* :func:`warm_path` ``(weights, steps, profile)``: what ComfyUI's sampler pays membackend per layer per
  step. ComfyUI's ``cast_modules_with_vbar`` calls, per layer and step, ``vbar_fault``,
  ``vbar_signature_compare`` and (after the layer ran) ``vbar_unpin``; on a resident layer that is all
  membackend adds to a warm prompt. On a simulated GPU, in a started adapter: **warm** (the facade as
  it serves: a range that stayed resident is pinned again with no session call) against **checked**
  (the same calls with the facade's warm ranges dropped before each fault, so each goes through the
  policy's checked path and the session). Returns ``{"warm": us, "checked": us, "ratio": warm/checked}``,
  microseconds per weight for fault + compare + unpin.
* :func:`file_read` ``(mib)``: a weight's file slice read into host memory from the page cache, one
  ``pread`` thread against the adapter's chunked reads on its reader threads (comfy-aimdo reads with
  a pool of 8). Returns ``{"one thread": GB/s, "reader threads": GB/s, "ratio": threads/one}``.

Both leave nothing running: :func:`warm_path` stops the runtime it started and records the process's
start-up decision as stock (``bench over``), whatever happened; :func:`file_read` closes its buffer
and puts the reader-thread gate back. Errors: :class:`~membackend.types.MembackendError`
from the session (a profile that is not simulated is a ``ConfigError``; a warm layer whose signature
changed, its pages not resident after all, is ``NotResident``), ``OSError`` from the file.
"""

from __future__ import annotations

import os
import tempfile
import time

from .._comfyui import buffers
from .._comfyui import runtime as adapter
from .._comfyui import vbar as facade
from .._drivers.open import machine_for
from .._manager import BackendManager
from .._settings import load_settings
from ..types import NotResident

__all__ = ["warm_path", "file_read"]


def _started(profile: str) -> adapter.Runtime:
    """A started adapter runtime over a simulated ``profile`` (no headroom), wired to nothing."""
    settings = load_settings(sim_profile=profile, headroom=0)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    rt = adapter.Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None)
    rt.start([(0, 0)])
    rt.started = True
    adapter.decided("armed", "bench", "membackend.lab.adapter", rt)
    return rt


def _passes(allocs: list, signatures: list, steps: int, vbar: facade.ModelVBAR | None) -> float:
    """Seconds for ``steps`` passes of fault + compare + unpin over ``allocs``; with ``vbar``, its warm
    ranges are dropped before each fault (the checked path)."""
    start = time.perf_counter()
    for _ in range(steps):
        for a, sig in zip(allocs, signatures):
            if vbar is not None:
                vbar._warm.clear()
            s = facade.vbar_fault(a)
            if not facade.vbar_signature_compare(s, sig):
                raise NotResident("a warm layer's signature changed: the benchmark's pages were not resident")
            facade.vbar_unpin(a)
    return time.perf_counter() - start


def warm_path(weights: int = 700, steps: int = 20, profile: str = "h200", rounds: int = 3) -> dict[str, float]:
    """Microseconds per weight of fault + compare + unpin, warm and checked, over ``weights`` layers of
    600,000 bytes for ``steps`` steps on simulated ``profile``, best of ``rounds``; and their ratio."""
    rt = _started(profile)
    try:
        v = facade.ModelVBAR(1 << 30, 0)
        try:
            allocs = [v.alloc(600_000) for _ in range(weights)]
            signatures = []
            for a in allocs:  # the cold step: every layer faulted and copied once
                signatures.append(facade.vbar_fault(a))
                facade.vbar_unpin(a)
            figures: dict[str, float] = {}
            for _round in range(rounds):
                for name, dropped in (("warm", None), ("checked", v)):
                    t = _passes(allocs, signatures, steps, dropped) / (steps * weights) * 1e6
                    figures[name] = min(figures.get(name, t), t)
        finally:
            v.close()
    finally:
        rt.stop()
        adapter.decided("stock", "bench over", "", None)
    return {**figures, "ratio": figures["warm"] / figures["checked"]}


def file_read(mib: int = 512, rounds: int = 3) -> dict[str, float]:
    """GB/s reading a file of ``mib`` MiB from the page cache into a host buffer, on one thread and on
    the adapter's reader threads (used here whatever the cores; the adapter uses them from 4), best of
    ``rounds``; and their ratio."""
    size = mib << 20
    gate = buffers.READ_THREADS_FROM
    buffers.READ_THREADS_FROM = 1
    best: dict[str, float] = {}
    try:
        with tempfile.NamedTemporaryFile() as f:
            f.write(os.urandom(1 << 20) * mib)
            f.flush()
            hb = buffers.HostBuffer(0, 0, size)
            view = memoryview(hb._map)[:size]
            try:
                view[::4096] = b"\1" * len(view[::4096])  # the buffer's pages exist before either read
                for _round in range(rounds):
                    for name in ("one thread", "reader threads"):
                        start = time.perf_counter()
                        if name == "one thread":
                            buffers._pread(f.fileno(), view, 0)
                        else:
                            buffers._read_into(f.fileno(), view, 0, "bench")
                        rate = size / (time.perf_counter() - start) / 1e9
                        best[name] = max(best.get(name, 0.0), rate)
            finally:
                view.release()
                hb.close()
    finally:
        buffers.READ_THREADS_FROM = gate
    return {**best, "ratio": best["reader threads"] / best["one thread"]}
