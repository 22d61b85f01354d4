"""A resident model on ComfyUI's classic path (issue 41): no fault, compare or unpin per weight per step.

ComfyUI's dynamic path costs every layer of every step a ``vbar_fault``, a signature compare, a cast-path
check and a ``vbar_unpin`` even when every weight is resident: on a big card half again the classic path's
time (1.41 s against 0.96 s a warm SD1.5 prompt on an H200). So when a dynamic model ComfyUI loads for a run
is wholly resident, the adapter lets ComfyUI run it as a fully loaded model without dynamic VRAM -- it
*promotes* it (:meth:`ClassicPath.promote`):

* **When.** Right after ComfyUI's ``load_models_gpu`` loaded it (``ModelPatcherDynamic.load`` ran): every
  module with a VBAR slot (``_v``) faults resident with the signature of the bytes ComfyUI last copied in
  (its ``_v_signature``: nothing was freed, failed or replaced since), and no weight function applies -- no
  LoRA or other patch (``patches``, ``weight_wrapper_patches``, a lowvram function, a weight or bias
  function), no hook, no prefetch or cross-step state left on a module, no quantized weight. Otherwise it
  stays on the dynamic path: a model that fits only in part keeps its resident prefix and streams the rest.
* **How, with no copy.** Each such module's ``weight`` and ``bias`` become parameters over the device tensors
  ComfyUI itself made over the module's own pages (``_v_weight`` / ``_v_bias``, which its dynamic path reads
  on every resident step); its ``_v`` slot (and a unit's ``_v_block``) is put aside, so the cast path, the
  prefetch queues and CUDA-graph capture no longer see a VBAR module; and ``comfy_cast_weights`` takes the
  value ComfyUI's classic full load leaves -- the op class's own (or the patcher's ``force_cast_weights``),
  kept on where a weight's dtype is not the model's (the cast branch then casts, as the dynamic path does).
  The force-loaded small modules, already on the device, get the same value. The residency manager keeps the
  pages (:meth:`ResidencyManager.hold <membackend._residency.manager.ResidencyManager.hold>`).
* **Back to the dynamic path before any of those pages can go** (*demoted*): the hold's end restores every
  module exactly (the original parameters, the slot, the instance's ``comfy_cast_weights``), marks a fence on
  ComfyUI's current stream (a later free waits for the kernels already queued over the pages, G2), and only
  then may a page go. The policy ends a hold for the model's own requests at once (ComfyUI's partial or full
  unload, ``/free``, a dropped model, ComfyUI loading it again) and for another model's room (eviction, a
  lowered cap, a budget drop) only while the model is outside the current run: a model the run uses keeps its
  pages, and the model that wanted the room streams. A lowered cap that had to wait is fitted again at the
  next quiescent point (:meth:`membackend._comfyui.runtime.Runtime.quiescent`).

Every swap keeps each intermediate state valid for a layer ComfyUI might run meanwhile: promoting, the weight
moves first and the slot goes after (a weight on the compute device takes the cast path's classic branch);
demoting, the slot comes back first and the weight last.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from .lines import say

if TYPE_CHECKING:
    from .links import RuntimeLinks

log = logging.getLogger("membackend")

__all__ = ["ClassicPath", "Promotion"]

_ABSENT = object()
#: a module's attributes that name its VBAR ranges: put aside while promoted
_SLOTS = ("_v", "_v_block")


def _plain(t: Any) -> bool:
    """A tensor the classic path can use as it is (not a quantized or other tensor subclass)."""
    import torch

    return t is None or type(t) in (torch.Tensor, torch.nn.Parameter)


class Promotion:
    """One VBAR's model on the classic path: what each module had, to put it back exactly (:meth:`end`)."""

    def __init__(self, links: "RuntimeLinks", vbar: Any, on_end: Any):
        self._links = links
        self._on_end = on_end  # the path's count of demotions
        self.vbar = vbar
        self.hold: Any = None
        #: (module, {attribute: what it was}) for each module changed; parameters are restored by setattr
        self.changed: list[tuple[Any, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.ended = False

    def apply(self, module: Any, params: dict[str, Any], cast: bool | None) -> None:
        """Promote one module: its ``params`` (name -> tensor over its pages) first, then its slots aside, then
        ``comfy_cast_weights`` (None: unchanged)."""
        import torch

        was: dict[str, Any] = {}
        self.changed.append((module, was))
        for name, tensor in params.items():
            was[name] = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))
        for name in _SLOTS:
            if name in module.__dict__:
                was[name] = module.__dict__[name]
                delattr(module, name)
        if cast is not None:
            was["comfy_cast_weights"] = module.__dict__.get("comfy_cast_weights", _ABSENT)
            module.comfy_cast_weights = cast

    def end(self, reason: str) -> None:
        """The hold's end (under the residency manager's lock): every module back as it was, in reverse order
        (the slot first, then the weights), then a fence on ComfyUI's current stream for the pages."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            changed, self.changed = self.changed, []
        failed = 0
        for module, was in reversed(changed):
            try:
                for name in _SLOTS:
                    if name in was:
                        setattr(module, name, was[name])
                cast = was.get("comfy_cast_weights", None)
                if cast is _ABSENT:
                    module.__dict__.pop("comfy_cast_weights", None)
                elif cast is not None:
                    module.comfy_cast_weights = cast
                for name in ("weight", "bias"):
                    if name in was:
                        setattr(module, name, was[name])
            except Exception as exc:  # noqa: BLE001 - one module that cannot be restored must not keep the rest
                failed += 1
                log.debug("membackend: restoring a module of %s: %s", self.vbar._model.id, exc)
        fences = self._links.fences()
        if fences is not None:  # kernels already queued over the pages: a free waits for them (G2)
            fences.after_unpin(self.vbar._model, self.vbar._dev, self.vbar._where)
        self.vbar._promotion = None
        self._on_end()
        if failed:
            say(f"back to the dynamic path: {failed} module(s) of {self.vbar._model.id} could not be restored "
                f"({reason})", logging.WARNING)
        log.debug("membackend: %s back on the dynamic path (%s)", self.vbar._model.id, reason)


class ClassicPath:
    """The promotions of one runtime's models (see the module docstring); ``links``: what it reads of the
    runtime now."""

    def __init__(self, links: "RuntimeLinks"):
        self._links = links
        self.enabled = True
        self.promoted = 0  # promotions since start-up
        self.demoted = 0
        #: why the last model that stayed dynamic did (the model id -> words), for the status
        self.why_not: dict[str, str] = {}

    # ------------------------------------------------------------------ promote

    def promote(self, patcher: Any, vbar: Any) -> bool:
        """Put ``vbar``'s model on the classic path when it is wholly resident and nothing patches its weights
        (see the module docstring); True when it is (or was already). Raises nothing it can avoid: anything
        unexpected is the caller's to report, with every module put back."""
        links = self._links
        if vbar._promotion is not None:
            return True
        residency = links.residency()
        if not self.enabled or links.aborted() is not None or vbar._closed or residency is None:
            return False
        module = getattr(patcher, "model", None)
        modules = list(module.modules()) if module is not None else []
        slotted = [m for m in modules if "_v" in m.__dict__ and isinstance(m._v, tuple) and m._v[0] is vbar]
        why = self._ineligible(patcher, modules, slotted) or self._not_resident(residency, vbar, slotted)
        if why is not None:
            self.why_not[vbar._model.id] = why
            return False
        ids = {id(m) for m in slotted}
        pinned: list[tuple[int, int]] = []
        promotion = Promotion(links, vbar, self._demoted)
        try:
            for m in slotted:  # faulted as the cast path would: resident, with the bytes last copied in
                _, alloc, size = m._v
                signature = vbar.fault(alloc, size)
                if signature is None:
                    self.why_not[vbar._model.id] = "not every weight is resident"
                    return False
                pinned.append((alloc, size))
                if not _same(signature, m._v_signature):
                    self.why_not[vbar._model.id] = "a weight's pages changed since ComfyUI copied it"
                    return False
            dtype = patcher.model_dtype() if callable(getattr(patcher, "model_dtype", None)) else None
            backed = set(getattr(patcher, "backup", {}) or {})  # force-loaded: on the device already
            force = bool(getattr(patcher, "force_cast_weights", False))
            for n, m in _named(module, modules):
                if id(m) in ids:
                    params = {"weight": m._v_weight}
                    if getattr(m, "bias", None) is not None:
                        params["bias"] = m._v_bias
                    promotion.apply(m, params, _classic_cast(m, params, dtype, force))
                elif hasattr(m, "comfy_cast_weights") and f"{n}.weight" in backed:
                    own = {k: getattr(m, k) for k in ("weight", "bias") if getattr(m, k, None) is not None}
                    promotion.apply(m, {}, _classic_cast(m, own, dtype, force))
                elif "_v_block" in m.__dict__:
                    promotion.apply(m, {}, None)
            base = vbar.base_addr
            lo = min(alloc for alloc, _ in pinned) - base
            hi = max(alloc + size for alloc, size in pinned) - base
            hold = residency.hold(vbar._model, lo, hi - lo, vbar._dev, promotion.end)
            if hold is None:
                self.why_not[vbar._model.id] = "a page went while it was being promoted"
                promotion.end("not held")
                return False
            promotion.hold = hold
            vbar._promotion = promotion
            self.promoted += 1
            self.why_not.pop(vbar._model.id, None)
            log.debug("membackend: %s on the classic path (%d modules)", vbar._model.id, len(promotion.changed))
            return True
        except BaseException:
            if vbar._promotion is not promotion:
                promotion.end("promotion failed")
            raise
        finally:
            for alloc, size in pinned:
                vbar.unpin(alloc, size)

    def _demoted(self) -> None:
        self.demoted += 1

    @staticmethod
    def _not_resident(residency: Any, vbar: Any, slotted: list[Any]) -> str | None:
        """Why the pages of ``slotted``'s ranges are not all resident now (None: they are), read from the page
        map, so that checking a model faults in nothing ComfyUI did not ask for."""
        r = vbar._model.reservation(vbar._dev)
        if r is None:
            return "its range was given back"
        page = r.page_size
        bits = residency.residency(vbar._model, vbar._dev)
        base = vbar.base_addr
        for m in slotted:
            _, alloc, size = m._v
            first, last = (alloc - base) // page, (alloc - base + size - 1) // page + 1
            if last > len(bits) or not all(b & 1 for b in bits[first:last]):
                return "not every weight is resident"
        return None

    @staticmethod
    def _ineligible(patcher: Any, modules: list[Any], slotted: list[Any]) -> str | None:
        """Why the model cannot leave the dynamic path now; None when it can."""
        if not slotted:
            return "no weight of it is in its VBAR"
        if getattr(patcher, "patches", None) or getattr(patcher, "weight_wrapper_patches", None) \
                or getattr(patcher, "hook_patches", None) or getattr(patcher, "forced_hooks", None):
            return "its weights are patched (LoRA, hooks): they stay on the dynamic path"
        for m in modules:
            d = m.__dict__
            if "_prefetch" in d or "_comfy_cross_step_state" in d:
                return "a module is in the middle of a run (prefetch or cross-step state)"
            if any(d.get(f"{p}_lowvram_function") is not None or d.get(f"{p}_function") for p in ("weight", "bias")):
                return "its weights are patched (LoRA, hooks): they stay on the dynamic path"
        for m in slotted:
            d = m.__dict__
            if d.get("_v_signature") is None or "_v_weight" not in d:
                return "not every weight has been copied in yet"
            if not _plain(d["_v_weight"]) or not _plain(d.get("_v_bias")):
                return "a weight is quantized"
            if getattr(m, "bias", None) is not None and d.get("_v_bias") is None:
                return "not every weight has been copied in yet"
        return None

    # ------------------------------------------------------------------ demote

    def demote(self, vbar: Any, reason: str) -> bool:
        """Put ``vbar``'s model back on the dynamic path now (the caller is at a point where it does not run);
        False when it was not promoted."""
        promotion = vbar._promotion
        if promotion is None:
            return False
        hold = promotion.hold
        if hold is not None:
            return bool(hold.end(reason))
        promotion.end(reason)
        return True

    def demote_all(self, reason: str) -> int:
        """Every promoted model back on the dynamic path (the adapter switched off, or stops)."""
        done = 0
        for vbar in list(self._links.vbars):
            if getattr(vbar, "_promotion", None) is not None:
                done += self.demote(vbar, reason)
        return done

    def held(self) -> list[str]:
        """The ids of the models on the classic path now."""
        return [v._model.id for v in list(self._links.vbars) if getattr(v, "_promotion", None) is not None]


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    return memoryview(a) == memoryview(b)


def _named(root: Any, modules: list[Any]) -> list[tuple[str, Any]]:
    """``root.named_modules()`` (names as ComfyUI's patch keys spell them); the modules already listed."""
    try:
        return list(root.named_modules())
    except Exception:  # noqa: BLE001 - a module without names: only the slotted ones are promoted then
        return [("", m) for m in modules]


def _classic_cast(module: Any, params: dict[str, Any], model_dtype: Any, force: bool) -> bool:
    """``comfy_cast_weights`` as ComfyUI's classic full load leaves it: the op class's own value (or on with the
    patcher's ``force_cast_weights``), kept on where a weight's dtype is not the one the model computes in (the
    module's ``<param>_comfy_model_dtype``, else the model's): the cast branch then casts it, as the dynamic
    path does."""
    if force or getattr(type(module), "comfy_cast_weights", True):
        return True
    for name, tensor in params.items():
        want = getattr(module, f"{name}_comfy_model_dtype", None) or model_dtype
        if tensor is not None and (want is None or tensor.dtype != want):
            return True
    return False
