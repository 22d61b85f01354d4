"""Start-up inside ComfyUI, before torch: settings, the decision to take over, and one log line.

ComfyUI's ``main.py`` runs, in this order: its arguments; ``comfy_aimdo.control.init()``
(only when ``comfy.cli_args.enables_dynamic_vram()`` is true); the custom nodes'
prestartup scripts -- :func:`prestartup` here -- then the first torch import; then,
when ``args.enable_dynamic_vram`` is set or dynamic VRAM is enabled and supported
by the device, ``comfy_aimdo.control.init_devices(...)``, and when that answers True,
``comfy_aimdo.control.set_log_<level>()`` and the swap to ``ModelPatcherDynamic``.

**The decision** (:func:`decide`). membackend takes over only where ComfyUI will
run its dynamic path on devices the selected backend serves; everywhere else
nothing is patched, ComfyUI runs exactly stock, and the line says why:

========================================================  ======================================
case                                                      outcome
========================================================  ======================================
``MEMBACKEND_DISABLE=1``                                  off
ComfyUI's own rule says no dynamic VRAM (``--cpu``,       stock (no selection is even made)
``--highvram``, ``--gpu-only``, ``--novram``,
``--disable-dynamic-vram``)
``aimdo`` selected                                        stock: ComfyUI's comfy-aimdo runs
no GPU backend fits (the ``host`` fallback)               stock
a backend that serves no GPU (``host`` forced)            stock: ComfyUI's dynamic path makes no
                                                          address range for a CPU device
``--cpu --enable-dynamic-vram`` on real machine facts     stock: the device is the CPU
otherwise (a simulated profile counts as a GPU served)    armed: :class:`~.runtime.Runtime`
========================================================  ======================================

Armed, :meth:`Runtime.arm <membackend._comfyui.runtime.Runtime.arm>` makes
``init_devices`` ours; whether ComfyUI calls it (the device's support for dynamic
VRAM) stays ComfyUI's own decision. ComfyUI's ``--lowvram`` does not change the
decision (ComfyUI ignores it under dynamic VRAM), ``--disable-smart-memory``
switches keep-warm off, ``--reserve-vram`` and ``--vram-headroom`` reach the
budget's headroom, ``--cuda-device`` is the device set ComfyUI passes.

Cheap by design: settings come from :func:`membackend._settings.quick_settings`
(no pydantic unless a value needs it); the policy, the facade and the buffers are
imported only when ``init_devices`` starts membackend (:mod:`membackend.lab.startup_cost`
measures what it costs).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from .._settings import quick_settings
from . import runtime as _runtime
from .runtime import HOW_TO, Runtime, say

__all__ = ["prestartup", "decide", "comfy_dynamic_vram", "Decision", "SERVE_CPU_DEVICES", "current"]

current = _runtime.current  # the adapter of this process (see membackend._comfyui.runtime)

#: ComfyUI's ``ModelPatcherDynamic.__new__`` gives a CPU load device a plain ``ModelPatcher`` (no VBAR), and
#: forcing dynamic VRAM in a CPU process breaks ComfyUI's own sampling: a backend serving only the CPU never
#: takes over. The stand-in ComfyUI in the test suite, whose dynamic patcher does stream weights on the CPU
#: (the only way to run the facade without a GPU), turns this on.
SERVE_CPU_DEVICES = False

#: ComfyUI's flags that switch its dynamic VRAM off (``comfy/cli_args.py``, ``enables_dynamic_vram``)
_DYNAMIC_OFF = (("disable_dynamic_vram", "--disable-dynamic-vram"), ("highvram", "--highvram"),
                ("gpu_only", "--gpu-only"), ("novram", "--novram"), ("cpu", "--cpu"))


def comfy_dynamic_vram(cli: Any) -> tuple[bool, str]:
    """ComfyUI's own rule for dynamic VRAM (``comfy.cli_args.enables_dynamic_vram()``) and the flag that
    decided it, as typed. ``cli`` is the ``comfy.cli_args`` module (or anything with ``args``); the real
    function answers where it exists, the flags only name the reason."""
    args = getattr(cli, "args", None)
    if args is None:
        return True, "no ComfyUI arguments"
    rule = getattr(cli, "enables_dynamic_vram", None)
    if getattr(args, "enable_dynamic_vram", False):
        return (bool(rule()) if callable(rule) else True), "--enable-dynamic-vram"
    flag = next((f for attr, f in _DYNAMIC_OFF if getattr(args, attr, False)), None)
    on = bool(rule()) if callable(rule) else flag is None
    return on, "ComfyUI's default" if on or flag is None else flag


@dataclass(frozen=True)
class Decision:
    """What :func:`prestartup` does: ``take_over`` or not, the status ``state``, and the line's words."""

    take_over: bool
    state: str  # "disabled", "stock" or "armed"
    text: str  # the start-up line, after "membackend <version>: "


def _brief(text: object, limit: int = 70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1].rsplit(" ", 1)[0] + "…"


def _how(selection: Any, settings: Any) -> str:
    """The selection's reason in a few words (the whole of it: ``membackend doctor``, the status route)."""
    if selection.how == "forced":
        words = "forced by MEMBACKEND_BACKEND" if os.environ.get("MEMBACKEND_BACKEND") else "forced by settings"
    else:
        cand = selection.candidates.get(selection.record.name)
        words = f"best fit, score {cand.score}" if cand is not None else selection.how
    profile = getattr(settings, "sim_profile", None)
    return f"{words}; simulated {profile}" if profile else words


def decide(settings: Any, cli: Any, select: Any) -> tuple[Decision, Any]:
    """The take-over decision (see the module docstring). ``select()`` makes the selection, only when it
    matters; returns ``(decision, selection or None)``."""
    if settings.disable:
        return Decision(False, "disabled", "off (MEMBACKEND_DISABLE=1); ComfyUI runs stock; unset "
                                           "MEMBACKEND_DISABLE to turn membackend on"), None
    dynamic, why = comfy_dynamic_vram(cli)
    if not dynamic:
        return Decision(False, "stock", f"ComfyUI runs stock: its dynamic VRAM is off ({why}), and membackend "
                                        "serves only that; details: membackend doctor"), None
    sel = select()
    name = sel.record.name if sel.record else None
    if name == "aimdo":
        return Decision(False, "stock", f"ComfyUI runs stock with its own comfy-aimdo (aimdo {sel.how}); "
                                        f"{HOW_TO}"), sel
    if sel.how == "fallback":
        return Decision(False, "stock", f"ComfyUI runs stock: no GPU backend fits ({_brief(sel.reason, 60)}); "
                                        f"{HOW_TO}"), sel
    kinds = tuple(getattr(sel.record.plugin, "device_kinds", ("cpu",)))
    if not any(k in kinds for k in ("cuda", "hip")) and not SERVE_CPU_DEVICES:
        return Decision(False, "stock", f"ComfyUI runs stock: {name} serves no GPU, and ComfyUI's dynamic VRAM "
                                        f"runs only on GPUs; {HOW_TO}"), sel
    args = getattr(cli, "args", None)
    if getattr(args, "cpu", False) and not getattr(settings, "sim_profile", None) and not SERVE_CPU_DEVICES:
        return Decision(False, "stock", f"ComfyUI runs stock: its device is the CPU (--cpu), which {name} does "
                                        f"not serve; {HOW_TO}"), sel
    return Decision(True, "armed", f"using {name} ({_how(sel, settings)}); {HOW_TO}"), sel


def _wire(rt: Runtime) -> None:
    from . import wiring

    wiring.wire(rt)


def prestartup() -> Runtime | None:
    """The prestartup script's work: decide, log one line, arm the runtime when taking over; never raises."""
    rt = None
    try:
        settings = quick_settings()
        cli = sys.modules.get("comfy.cli_args")
        holder: dict[str, Any] = {}

        def select() -> Any:
            from .._drivers.open import machine_for
            from .._manager import BackendManager

            holder["manager"] = mgr = BackendManager(settings)
            holder["machine"] = machine = machine_for(settings)
            return mgr.select(machine)

        decision, sel = decide(settings, cli, select)
        if decision.take_over:
            rt = Runtime(holder["manager"], holder["machine"], sel, wire=_wire,
                         comfy_args=getattr(cli, "args", None))
            rt.arm()
            if getattr(rt.comfy_args, "disable_smart_memory", False):
                rt.keep.enabled = False  # ComfyUI's --disable-smart-memory: nothing is kept warm by us either
        _runtime.decided(decision.state, decision.text, say(decision.text), rt)
        return rt
    except Exception as exc:
        if rt is not None:
            rt.patches.restore()
        text = (f"not started ({type(exc).__name__}: {_brief(exc, 75)}); ComfyUI runs stock; see membackend doctor, "
                "or set MEMBACKEND_DISABLE=1")
        _runtime.decided("not-started", f"{type(exc).__name__}: {exc}", say(text, logging.WARNING))
        return None
