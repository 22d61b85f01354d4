"""What the ComfyUI adapter adds to ComfyUI's start-up, as a ratio to ``python -c "import torch"``.

:func:`measure_startup` runs each side in a fresh interpreter (imports are cached per
process), in the current Python, with no ``MEMBACKEND_*`` variable and in an empty
directory (no config file), and alternates the sides in rounds; each side keeps its best
round, because the machines this runs on are shared and noisy.

* ``torch``: ``import torch``, timed inside the interpreter.
* ``adapter, auto``: the prestartup script's work with this machine's own selection (on a
  machine without a GPU: the fallback, nothing patched), timed inside the interpreter.
* ``adapter, started``: the prestartup script's work with ``MEMBACKEND_BACKEND=host``, then
  the ``init_devices`` hook starting membackend (session, policy, facade, wiring): the most
  the adapter does before ComfyUI's first node. torch is imported between the two, as
  ComfyUI does, and that import is not counted. ``comfy.model_management`` is an empty
  stand-in module, so the wiring's names are skipped.
* ``torch, after prestartup`` (a cross-check): that ``import torch`` inside the ``adapter,
  started`` interpreter, the step the adapter's figure leaves out. Well above ``torch``
  would mean the adapter makes torch's own import dearer. (The wall time of whole
  interpreters was tried as a cross-check and dropped: on a shared machine it scatters by
  half a second, more than the quantity it would check.)

The adapter's figure (``adapter_seconds``) is the larger of its two sides; ``ratio`` is that
over ``torch_seconds``. Target: ratio <= 0.15.

Bytecode: by default (``bytecode_cache=True``) every interpreter reads and writes compiled
bytecode in a private cache (``PYTHONPYCACHEPREFIX`` in the temporary directory; a set
``PYTHONDONTWRITEBYTECODE`` is dropped), and one discarded warm-up run of each kind fills
it first, so both sides load compiled modules, as an installed package and torch do. With
``bytecode_cache=False`` the interpreters inherit this environment as it is: where
``PYTHONDONTWRITEBYTECODE`` is set and membackend is an editable checkout without
``__pycache__``, the adapter then compiles its modules from source on every start (torch
keeps the bytecode pip wrote), which is a cost of that development set-up, not of ComfyUI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..types import TorchMissing
from ..types import _StartupCostError as StartupCostError

__all__ = ["measure_startup", "format_startup", "StartupCostError", "TorchMissing", "TARGET"]

TARGET = 0.15

TORCH = """if True:
    import json, time
    t = time.perf_counter()
    import torch
    print(json.dumps({"seconds": time.perf_counter() - t}))
"""
ADAPTER = """if True:
    import json, sys, time, types
    sys.modules.setdefault("comfy.model_management", types.ModuleType("comfy.model_management"))
    t0 = time.perf_counter()
    from membackend._comfyui import startup
    startup.SERVE_CPU_DEVICES = True  # host starts as a GPU backend would on a GPU machine: the most it does
    rt = startup.prestartup()
    t1 = time.perf_counter()
    import torch  # ComfyUI imports torch between the prestartup scripts and init_devices: not the adapter's
    t2 = time.perf_counter()
    started = rt is not None and rt.init_devices([(0, 0)])
    t3 = time.perf_counter()
    aborted = rt.aborted if rt is not None else None
    if rt is not None:
        rt.stop()
    print(json.dumps({"seconds": (t1 - t0) + (t3 - t2), "torch_seconds": t2 - t1, "armed": rt is not None,
                      "started": bool(started), "aborted": aborted}))
"""
SIDES = ("torch", "adapter, auto", "adapter, started", "torch, after prestartup")


def _env(extra: dict[str, str], pycache: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MEMBACKEND_")}
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this membackend package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    env.update(extra)
    return env


def _run(code: str, extra: dict[str, str], cwd: str, pycache: str | None) -> dict[str, Any]:
    """What the child printed: its last line, JSON."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(extra, pycache),
                       cwd=cwd, timeout=600)
    if p.returncode != 0 or not p.stdout.strip():
        raise StartupCostError(f"the measuring interpreter failed (exit {p.returncode}): {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _adapter(extra: dict[str, str], cwd: str, pycache: str | None, must_start: bool) -> dict[str, Any]:
    got = _run(ADAPTER, extra, cwd, pycache)
    if must_start and not got["started"]:
        raise StartupCostError("membackend did not start on the host backend, so its start-up was not measured "
                               f"(armed: {got['armed']}, aborted: {got['aborted']}); is comfy-aimdo installed?")
    return got


def measure_startup(rounds: int = 3, *, bytecode_cache: bool = True) -> dict[str, Any]:
    """Measure the adapter's start-up against ``import torch``, best of ``rounds`` rounds per side.

    Returns ``{"torch_seconds", "adapter_seconds", "ratio", "target", "rounds", "bytecode_cache",
    "rows"}``: ``rows`` maps each side (:data:`SIDES`, see the module docstring) to
    ``{"seconds", "ratio"}``, the ratio over ``torch_seconds``. ``bytecode_cache``: see the
    module docstring.

    Raises :class:`TorchMissing` when torch is not installed in this Python, and
    :class:`StartupCostError` when a measuring interpreter fails or membackend does not start
    on the host backend (comfy-aimdo missing, say). Takes about ``rounds`` times three torch
    imports, plus one more of each with ``bytecode_cache`` (the warm-up, not counted).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds!r}")
    if importlib.util.find_spec("torch") is None:
        raise TorchMissing(f"torch is not installed in {sys.executable}: nothing to compare the adapter with")
    best = dict.fromkeys(SIDES, float("inf"))
    with tempfile.TemporaryDirectory(prefix="membackend-startup-") as cwd:  # no config file in the way
        pycache = os.path.join(cwd, "pycache") if bytecode_cache else None
        if pycache is not None:  # warm-up: compile both sides' modules once
            _run(TORCH, {}, cwd, pycache)
            _adapter({}, cwd, pycache, must_start=False)
            _adapter({"MEMBACKEND_BACKEND": "host"}, cwd, pycache, must_start=True)
        for _ in range(rounds):
            got = {"torch": _run(TORCH, {}, cwd, pycache)["seconds"]}
            got["adapter, auto"] = _adapter({}, cwd, pycache, must_start=False)["seconds"]
            started = _adapter({"MEMBACKEND_BACKEND": "host"}, cwd, pycache, must_start=True)
            got["adapter, started"], got["torch, after prestartup"] = started["seconds"], started["torch_seconds"]
            best = {k: min(best[k], float(got[k])) for k in SIDES}
    torch_s = best["torch"]
    adapter_s = max(best["adapter, auto"], best["adapter, started"])
    rows = {k: {"seconds": best[k], "ratio": best[k] / torch_s} for k in SIDES}
    return {"torch_seconds": torch_s, "adapter_seconds": adapter_s, "ratio": adapter_s / torch_s,
            "target": f"<= {TARGET}", "rounds": rounds, "bytecode_cache": bytecode_cache, "rows": rows}


def format_startup(result: dict[str, Any]) -> str:
    """:func:`measure_startup`'s result as the table the benchmark prints."""
    cache = "bytecode cached" if result.get("bytecode_cache", True) else "bytecode as this environment has it"
    lines = [f"ComfyUI adapter start-up vs `import torch` (best of {result['rounds']} rounds each, alternating; "
             f"{cache})",
             f"{'side':<24} {'seconds':>9} {'ratio':>7}"]
    for name, row in result["rows"].items():
        lines.append(f"{name:<24} {row['seconds']:>9.3f} {row['ratio']:>7.2f}")
    lines.append(f"adapter: {result['adapter_seconds']:.3f} s = {result['ratio']:.2f} of import torch "
                 f"(target {result['target']})")
    return "\n".join(lines)
