"""What membackend patches into ComfyUI when it starts: the facade, the buffers, ``comfy.model_management``
and ``execution.PromptQueue``.

:func:`wire` is the ``wire`` function :class:`~membackend._comfyui.runtime.Runtime` calls
once its session is open. ComfyUI's functions it replaces are one table, :data:`PATCH_POINTS` (where each
lives, the names its replacement reads, how the replacement is built), each row applied through
``Patches.replace``. Each patch is feature-detected (a name this ComfyUI lacks
is skipped and listed in the status), wrapped by :meth:`Runtime.guard` where it is a
ComfyUI function (an exception inside restores every original and calls ComfyUI's
own function with the same arguments, G6), and undone by ``Runtime.abort`` /
``Runtime.stop``.

* **The facade** (:mod:`.vbar`) over ``comfy_aimdo.model_vbar`` and
  ``comfy_aimdo.torch.aimdo_to_tensor``; comfy-aimdo's ``VRAMBuffer``, ``HostBuffer``,
  ``ModelMMAP`` and ``read_file_to_device`` (:mod:`.buffers`); comfy-aimdo 0.5.5's and
  0.6.0's ``control.set/get_simple_vram_headroom`` and ``host_buffer.write_*_to_file``
  (:mod:`.aimdo_newer`); and wherever ComfyUI's modules bound those names. These are the
  *surface*: an abort after start leaves them for the dynamic patchers ComfyUI already made.
  Every public name of comfy-aimdo 0.4.13, 0.5.5 and 0.6.0 is served here (:func:`served`),
  left to comfy-aimdo with the reason (:data:`LEFT_TO_AIMDO`), or kept out by a ComfyUI switch
  membackend sets (:mod:`.aimdo_names`, the one table of all three).
* **Budgets (G3).** ``get_free_memory(dev=None, torch_free_too=False)`` answers the
  backend's free memory (from the platform's source) minus membackend's own headroom
  (``Session.free_for_host``): ComfyUI's ``--reserve-vram`` and ``--vram-headroom`` bound
  the weights' budget but are not subtracted here, since ComfyUI accounts for them itself
  and stock's figure does not change with them (so its choices, and the images, match
  stock's under the same flag); and
  ``get_total_memory(dev=None, torch_total_too=False)`` its total, for the devices the
  backend serves (others -- the CPU -- stay ComfyUI's); the import-time ``total_vram``
  (MiB) is set from it when ComfyUI's device is served.
* **Keep warm (G4).** ``free_memory(memory_required, device, keep_loaded=[], ...)``:
  when the policy can make the room itself (``memory_required`` no more than the
  usable budget plus the bytes it could evict), dynamic models are hidden from
  ComfyUI's victim choice, so a workflow switch leaves them resident; the policy
  evicts on pressure, least recently used first, never a model of the current run.
  An "everything" request (ComfyUI's ``1e30`` sentinel: ``unload_all_models``) hides
  nothing, and neither does ComfyUI's ``--disable-smart-memory``.
  ``load_models_gpu(models, ...)`` declares the run (``ResidencyManager.use``) and
  holds strong references to its dynamic patchers (:mod:`.keepwarm`). It also names each dynamic
  model after its ComfyUI model class (the status and the per-load lines use the name) and notes when it
  was last loaded.
* **One line per load.** ``vbars_reset_watermark_limits`` (after every node) closes the loads that
  ``load_models_gpu`` opened (``ResidencyManager.loads_done``); :meth:`.journal.Journal.on_load` logs one line per
  model saying why it loaded what it did (kept / reloaded after an eviction / cold) and keeps it for the
  status.
* **Full unload (G1) and the Hook delegate (G5).** After ``free_memory`` returns, every
  dynamic model it removed whose nn.Module no loaded model still uses (clones share
  one) is fully unloaded: fenced, freed, its reservation returned; put off to the next
  quiescent point (between nodes) while any page is pinned. Its patcher's
  ``non_dynamic_delegate_model`` is dropped with it, and keep-warm lets go of it. ComfyUI loads a Hook
  delegate (``ModelPatcherDynamic.get_non_dynamic_delegate``, tracked) in place of its owner, so when
  ``free_memory`` removes the delegate, the owner's cached copy is dropped too. When ComfyUI
  unloads everything (``unload_all_models``: ``POST /free``), what the backend keeps for reuse
  (recycled handles, kept address windows) goes back too.
* **Idle.** ``execution.PromptQueue.task_done(item_id, ...)`` (the prompt worker calls it
  after each prompt): after ComfyUI's own, when ``get_tasks_remaining()`` says nothing
  is queued or running, :meth:`Runtime.idle` runs ``ResidencyManager.on_idle``. Patched
  on the class, so the queue ComfyUI creates after start-up has it.
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import buffers
from . import vbar as facade
from .runtime import AIMDO_LOG_LEVELS, Runtime, aimdo_log_noop, say

__all__ = ["wire", "served", "PatchPoint", "PATCH_POINTS", "FACADE_NAMES", "BUFFER_NAMES", "LEFT_TO_AIMDO"]

EVERYTHING = 1e29  # ComfyUI asks for 1e30 / 1e32 when it means "unload everything"
#: comfy_aimdo.model_vbar's names the facade replaces
FACADE_NAMES = ("ModelVBAR", "vbar_fault", "vbar_unpin", "vbar_signature_compare", "vbars_reset_watermark_limits",
                "vbars_analyze")
#: comfy-aimdo's names that need its device, replaced by membackend._comfyui.buffers
BUFFER_NAMES = (("comfy_aimdo.vram_buffer", "VRAMBuffer"), ("comfy_aimdo.host_buffer", "HostBuffer"),
                ("comfy_aimdo.host_buffer", "read_file_to_device"), ("comfy_aimdo.host_buffer", "cleanup_file_reader"),
                ("comfy_aimdo.model_mmap", "ModelMMAP"))


#: Every public name of comfy-aimdo 0.4.13, 0.5.5 and 0.6.0 that membackend leaves to comfy-aimdo while it serves,
#: and why no call of it reaches aimdo's native code for a device membackend serves (or why that is harmless).
#: With :func:`served` and ``aimdo_names.KEPT_OUT`` it makes the table of :mod:`.aimdo_names`, which a test
#: checks against the names read from each installed release.
LEFT_TO_AIMDO = {
    "comfy_aimdo.control.init": "ComfyUI calls it before the prestartup scripts; it only loads aimdo's library "
                                "(or fails to), which membackend then leaves unused",
    "comfy_aimdo.control.analyze": "returns at once: it walks the device contexts of aimdo's own init_devices, and "
                                   "there are none while membackend serves",
    "comfy_aimdo.control.set_log_detail": "in no comfy-aimdo release; main.py catches the AttributeError and calls "
                                          "set_log_info, which membackend serves",
    "comfy_aimdo.torch.hostbuf_to_tensor": "plain Python over the buffer's size and get_raw_address(), which "
                                           "membackend's HostBuffer answers",
    "comfy_aimdo.control.lib": "aimdo's native library (ctypes), loaded by control.init before the prestartup "
                               "scripts, or None where it failed to load; membackend never calls into it, and "
                               "every name that would call it for a served device is served or kept out",
    "comfy_aimdo.control.devctxs": "aimdo's own device contexts, filled only by aimdo's init_devices, which "
                                   "membackend answers instead: empty while membackend serves, so what walks it "
                                   "(analyze, get_total_vram_usage) makes no native call",
    "comfy_aimdo.control.detect_vendor": "plain Python: reads torch's version file to pick aimdo's CUDA or ROCm "
                                         "library for control.init; no native code, no device",
    "comfy_aimdo.control.init_device": "plain Python over init_devices, looked up in comfy_aimdo.control when it "
                                       "is called, where membackend's init_devices answers",
    "comfy_aimdo.control.get_devctx": "aimdo's lookup of a device its own init_devices set up: for a device "
                                      "membackend serves it finds none and raises RuntimeError ('not "
                                      "initialized'), touching no device; ComfyUI does not call it, and aimdo's "
                                      "callers of it (ModelVBAR, VRAMBuffer, record) are served or kept out",
    "comfy_aimdo.control.deinit": "no ComfyUI release read calls it (0.33 to 0.38); it tears down only what aimdo's "
                                  "own init_devices set up (device contexts, driver hooks), which never ran while "
                                  "membackend serves",
    "comfy_aimdo.control.get_total_vram_usage": "sums over aimdo's own device contexts: none while membackend "
                                                "serves, so 0 with no native call (membackend's usage reaches "
                                                "ComfyUI through get_free_memory and vbars_analyze, served)",
    **{f"comfy_aimdo.{module}.lib": "control.lib as this module bound it when imported (None where aimdo's library "
                                    "is not loaded); only this module's own functions and classes use it, and "
                                    "each is served, kept out or left here with its reason"
       for module in ("host_buffer", "model_mmap", "model_vbar", "storage", "vram_buffer")},
    "comfy_aimdo.model_vbar.PageoutCallback": "a ctypes function-pointer type (0.6.0), no native call of its own: "
                                              "aimdo's ModelVBAR wraps its pageout_callback in it, and membackend's "
                                              "ModelVBAR, the one ComfyUI constructs while membackend serves, "
                                              "takes the Python callable as it is",
    # Comfy-Org/ComfyUI comfy/storage.py @2d656ace126d: fast_storage(path) imports it on Windows only
    "comfy_aimdo.storage.fast_disk": "Windows only (ComfyUI 0.35+ comfy/storage.py fast_storage(); Linux reads "
                                     "sysfs): asks aimdo's library whether the disk behind a model file is a fast "
                                     "NVMe, from the disk's driver, touching no GPU and no aimdo device context; "
                                     "None where the library is not loaded. Harmless while membackend serves",
    "comfy_aimdo.torch.get_tensor_from_raw_ptr": "plain torch (a tensor over a raw address through "
                                                 "__cuda_array_interface__), no aimdo native code; ComfyUI does not "
                                                 "call it itself (aimdo's aimdo_to_tensor does, and that is served)",
    "comfy_aimdo.torch.get_torch_allocator": "experimental in aimdo (it logs 'experimental and unsupported') and "
                                             "called by no ComfyUI since 0.33; it only reads two function "
                                             "addresses from aimdo's library, touching no device",
    "comfy_aimdo.torch.CUDAPluggableAllocator": "made only by get_torch_allocator (above), which no ComfyUI since "
                                                "0.33 calls; building one reads two function addresses from "
                                                "aimdo's library, touching no device",
}


def served() -> dict[str, Any]:
    """Every comfy-aimdo name membackend replaces while it runs (``module.name``) and what answers it."""
    out: dict[str, Any] = {f"comfy_aimdo.model_vbar.{n}": getattr(facade, n) for n in FACADE_NAMES}
    out["comfy_aimdo.torch.aimdo_to_tensor"] = facade.aimdo_to_tensor
    out.update({f"{m}.{n}": getattr(buffers, n) for m, n in BUFFER_NAMES})
    out["comfy_aimdo.control.init_devices"] = Runtime.init_devices
    out.update({f"comfy_aimdo.control.set_log_{level}": aimdo_log_noop for level in AIMDO_LOG_LEVELS})
    from . import aimdo_newer  # comfy-aimdo 0.5.5's and 0.6.0's names that would reach a served device

    out.update({f"{m}.{n}": getattr(aimdo_newer, n) for m, n in aimdo_newer.NAMES})
    return out


def install_facade(rt: Runtime) -> None:
    """The facade and the buffers over comfy-aimdo's names, and wherever ComfyUI's modules bound them."""
    p = rt.patches
    mv = importlib.import_module("comfy_aimdo.model_vbar")
    originals: dict[str, tuple[Any, Any]] = {}  # name -> (aimdo's object, ours)
    for name in FACADE_NAMES:
        originals[name] = (getattr(mv, name), getattr(facade, name))
        p.replace(mv, name, getattr(facade, name), surface=True)
    try:
        ct = importlib.import_module("comfy_aimdo.torch")
    except ImportError:
        ct = None
    if ct is not None and p.replace(ct, "aimdo_to_tensor", facade.aimdo_to_tensor, required=False, surface=True):
        originals["aimdo_to_tensor"] = (p.original(ct, "aimdo_to_tensor"), facade.aimdo_to_tensor)
    for modname, name in BUFFER_NAMES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            p.skipped.append(f"{modname}.{name}")
            continue
        if p.replace(mod, name, getattr(buffers, name), required=False, surface=True,
                     label=f"{modname}.{name}"):
            originals[name] = (p.original(mod, name), getattr(buffers, name))
    originals.update(importlib.import_module(".aimdo_newer", __package__).install(rt))  # 0.5.5+ names, served
    # ComfyUI's modules that bound these names with ``from comfy_aimdo... import name``
    by_id = {id(theirs): (theirs, ours) for theirs, ours in originals.values()}
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == "comfy" or modname.startswith("comfy.") or modname == "execution"):
            continue
        for attr, value in list(vars(mod).items()):
            found = by_id.get(id(value))
            if found is not None and value is found[0]:
                p.replace(mod, attr, found[1], surface=True)


def _vbars_of(patcher: Any) -> list[facade.ModelVBAR]:
    module = getattr(patcher, "model", None)
    vbars = getattr(module, "dynamic_vbars", None) or {}
    return [v for v in list(vbars.values()) if isinstance(v, facade.ModelVBAR)]


def _dynamic(lm: Any) -> bool:
    patcher = lm.model
    return patcher is not None and bool(_vbars_of(patcher))


# --------------------------------------------------------------------------- the patch points


def _ours(rt: Runtime, mm: Any, dev: Any) -> bool:
    """Whether the backend serves ``dev`` (None: ComfyUI's torch device)."""
    if dev is None and callable(getattr(mm, "get_torch_device", None)):
        dev = mm.get_torch_device()
    return rt.serves(dev)


def _device_figure(rt: Runtime, mm: Any, original: Callable[..., Any], dev: Any, torch_too: bool,
                   figure: Callable[[Any], int]) -> Any:
    """One answer of ``get_free_memory`` / ``get_total_memory``: ComfyUI's own for a device the backend does not
    serve, else ``figure`` of the device (twice, as ``(figure, torch's)``, when ComfyUI asks for torch's too)."""
    if not _ours(rt, mm, dev):
        return rt.comfy(original, dev, torch_too)
    n = figure(rt.device_for(dev))
    return (n, n) if torch_too else n


def _get_free_memory(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """G3: free minus membackend's own headroom, not minus ComfyUI's --reserve-vram/--vram-headroom: ComfyUI
    accounts for those itself, and stock's figure does not change with them (``Session.free_for_host``)."""
    def free(d: Any) -> int:
        residency = rt.residency_manager()
        if residency.cached(d):  # less room than the headroom (another process took it): the cache goes first
            b = rt.session.budget_query(d)
            if b.free < b.headroom:
                residency.drop_cache(d, b.headroom - b.free, "the room fell below the headroom")
        return rt.session.free_for_host(d)

    def get_free_memory(dev=None, torch_free_too=False):
        return _device_figure(rt, mm, original, dev, torch_free_too, free)
    return get_free_memory


def _get_total_memory(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """G3: the backend's total for a device it serves."""
    def get_total_memory(dev=None, torch_total_too=False):
        return _device_figure(rt, mm, original, dev, torch_total_too, lambda d: rt.session.budget_query(d).total)
    return get_total_memory


def _free_memory(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """G1, G4, G5: dynamic models hidden from ComfyUI's victim choice while the policy can make the room;
    what ComfyUI removed fully unloaded after its own ``free_memory``."""
    def free_memory(memory_required, device, keep_loaded=[], *args, **kwargs):
        loaded = mm.current_loaded_models
        before = list(loaded)
        sizes = {id(v): v.loaded_size() for lm in before if not lm.is_dead() for v in _vbars_of(lm.model)}
        if _ours(rt, mm, device) and rt.residency_manager().cached(rt.device_for(device)):
            dev = rt.device_for(device)  # the cache goes before ComfyUI's own choice of what to unload
            short = min(float(memory_required), 1e19) - rt.session.free_for_host(dev)
            if short > 0:
                rt.residency_manager().drop_cache(dev, short, "room for a load of ComfyUI's")
        hide = []
        if memory_required < EVERYTHING and rt.keep.enabled:
            dev = rt.device_for(device)
            room = rt.session.budget_query(dev).usable + rt.residency_manager().evictable(dev)
            if memory_required <= room:
                hide = [lm for lm in before if not lm.is_dead() and _dynamic(lm)]
        if hide:
            hidden = {id(lm) for lm in hide}
            loaded[:] = [lm for lm in before if id(lm) not in hidden]
        try:
            result = rt.comfy(original, memory_required, device, keep_loaded, *args, **kwargs)
        finally:
            if hide:
                kept = {id(lm) for lm in loaded}
                new = [lm for lm in loaded if all(lm is not b for b in before)]
                loaded[:] = new + [lm for lm in before if id(lm) in hidden or id(lm) in kept]
        removed = [lm for lm in before if all(lm is not a for a in loaded)]
        try:
            if removed:
                _retire(rt, removed, loaded, sizes)
            if memory_required >= EVERYTHING and not rt.pending:
                # unload_all_models (POST /free): what the backend keeps for reuse goes back too (G1), so
                # the memory the driver holds returns to its start-up value
                rt.give_back()
        except Exception as exc:  # ComfyUI's own free_memory already ran: do not run it twice
            rt.abort(exc, "the full unload after free_memory")
        return result
    return free_memory


def _load_models_gpu(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """G4: the current run (``ResidencyManager.use``), its patchers held warm and named; issue 41: each wholly
    resident model of the run on ComfyUI's classic path (:mod:`.classic`)."""
    def load_models_gpu(models, *args, **kwargs):
        result = rt.comfy(original, models, *args, **kwargs)
        vbars = [v for m in models for v in _vbars_of(m)]
        for v in vbars:
            rt.cancel_put_off(v)
        _name(rt, models)
        if vbars:
            rt.residency_manager().use([v._model for v in vbars])
        rt.keep.hold([m for m in models if _vbars_of(m)])
        try:
            for m in models:
                for v in _vbars_of(m):
                    rt.classic.promote(m, v)
        except Exception as exc:  # ComfyUI's own load_models_gpu already ran: do not run it twice
            rt.abort(exc, "putting a resident model on ComfyUI's classic path")
        return result
    return load_models_gpu


def _dynamic_load(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """Issue 41: a model on the classic path goes back to the dynamic path before ComfyUI's
    ``ModelPatcherDynamic.load`` reads and sets its modules again (``load_models_gpu`` promotes it again); after
    it, which of the model's VBAR ranges hold plain weights (:mod:`.reuse`)."""
    def load(patcher, *args, **kwargs):
        for v in _vbars_of(patcher):
            rt.classic.demote(v, "loaded again by ComfyUI")
        result = rt.comfy(original, patcher, *args, **kwargs)
        try:
            for v in _vbars_of(patcher):  # which ranges take plain weights (item 2: only those are reused)
                rt.reuse.layout(patcher, v)
        except Exception as exc:  # ComfyUI's own load already ran: do not run it twice
            rt.abort(exc, "reading which of a model's ranges hold plain weights")
        return result
    return load


def _get_non_dynamic_delegate(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """G5: the Hook delegate, tracked from the moment ComfyUI makes it."""
    def get_non_dynamic_delegate(patcher, *args, **kwargs):
        delegate = rt.comfy(original, patcher, *args, **kwargs)
        rt.delegates.track(patcher, delegate)
        return delegate
    return get_non_dynamic_delegate


def _task_done(rt: Runtime, mm: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """Idle: after ComfyUI's own ``task_done``, the policy's idle work when the prompt queue emptied."""
    def task_done(queue, *args, **kwargs):
        result = rt.comfy(original, queue, *args, **kwargs)
        try:
            if queue.get_tasks_remaining() == 0:
                rt.idle()
        except Exception as exc:  # ComfyUI's own task_done already ran: do not run it twice
            rt.abort(exc, "giving back what the backend keeps when the prompt queue emptied")
        return result
    return task_done


def _model_management() -> Any:
    return importlib.import_module("comfy.model_management")


def _model_patcher_dynamic() -> Any:
    return getattr(sys.modules.get("comfy.model_patcher"), "ModelPatcherDynamic", None)


def _prompt_queue() -> Any:
    return getattr(sys.modules.get("execution"), "PromptQueue", None)  # imported by main.py before us


@dataclass(frozen=True)
class PatchPoint:
    """One ComfyUI function membackend replaces: where it lives, and how its replacement is built.

    ``owner()`` finds the module or class that holds ``name`` (None where this ComfyUI has none);
    ``requires`` are the other names of the owner the replacement reads; ``build(rt, model_management,
    original)`` returns the replacement, which :meth:`Runtime.guard` wraps (G6). Where the owner, the name
    or a required name is missing, the point is skipped and listed under ``label`` in the status."""

    label: str
    owner: Callable[[], Any]
    name: str
    build: Callable[[Runtime, Any, Callable[..., Any]], Callable[..., Any]]
    requires: tuple[str, ...] = ()


#: every ComfyUI function :func:`wire` replaces, in the order it patches them
PATCH_POINTS = (
    PatchPoint("comfy.model_management.get_free_memory", _model_management, "get_free_memory", _get_free_memory),
    PatchPoint("comfy.model_management.get_total_memory", _model_management, "get_total_memory",
               _get_total_memory),
    PatchPoint("comfy.model_management.free_memory", _model_management, "free_memory", _free_memory,
               requires=("current_loaded_models",)),
    PatchPoint("comfy.model_management.load_models_gpu", _model_management, "load_models_gpu", _load_models_gpu),
    PatchPoint("comfy.model_patcher.ModelPatcherDynamic.get_non_dynamic_delegate", _model_patcher_dynamic,
               "get_non_dynamic_delegate", _get_non_dynamic_delegate),
    PatchPoint("comfy.model_patcher.ModelPatcherDynamic.load", _model_patcher_dynamic, "load", _dynamic_load),
    PatchPoint("execution.PromptQueue.task_done", _prompt_queue, "task_done", _task_done,
               requires=("get_tasks_remaining",)),
)


def wire(rt: Runtime) -> None:
    """Everything membackend patches into ComfyUI once the runtime's session is open: the facade, every
    :data:`PATCH_POINTS` row (through ``Patches.replace``, skipped where this ComfyUI lacks it), then the
    budget's constants of ``comfy.model_management``."""
    install_facade(rt)
    mm = _model_management()
    for point in PATCH_POINTS:
        owner = point.owner()
        original: Any = getattr(owner, point.name, None)  # never called where the point is skipped
        rt.patches.replace(owner, point.name, rt.guard(point.name, original, point.build(rt, mm, original)),
                           required=False, label=point.label, requires=point.requires)
    _budget_constants(rt, mm)


def _budget_constants(rt: Runtime, mm: Any) -> None:
    """G3: the import-time ``total_vram`` (MiB) from the backend's total when ComfyUI's device is served; on
    one pool (GB10, an AMD APU) no pinned host copies of weights."""
    if not _ours(rt, mm, None):
        return
    own = rt.session.budget_query(rt.device_for(None))
    p = rt.patches
    p.replace(mm, "total_vram", own.total / (1024 * 1024), required=False)
    # one pool: a pinned host copy of a weight is the weight twice in the same memory, so ComfyUI pins
    # nothing there (its pin_memory and pinned_hostbuf_size read MAX_PINNED_MEMORY)
    gpu = rt.device_for(None).kind != "cpu"  # the host backend's pages are host memory already
    if gpu and own.unified and (getattr(mm, "MAX_PINNED_MEMORY", 0) or 0) > 0:
        p.replace(mm, "MAX_PINNED_MEMORY", 0, required=False)
        say("one memory pool with the host: ComfyUI's pinned host copies of weights are off")


def _name(rt: Runtime, patchers: list[Any]) -> None:
    """Each dynamic model's name (its ComfyUI model class: ``SDXL``, ``AutoencoderKL``, ``SD1ClipModel``) and
    when ComfyUI last loaded it, for the status and the per-load lines."""
    now = time.time()
    for patcher in patchers:
        module = getattr(patcher, "model", None)
        for v in _vbars_of(patcher):
            mid = v._model.id
            if mid not in rt.names:
                base = type(module).__name__ if module is not None else mid
                taken = set(rt.names.values())
                name, n = base, 1
                while name in taken:
                    n += 1
                    name = f"{base} #{n}"
                rt.names[mid] = name
            rt.last_used[mid] = now


def _retire(rt: Runtime, removed: list[Any], loaded: list[Any], sizes: dict[int, int]) -> None:
    """Full unload (G1) of removed dynamic models no loaded model still uses; drop their delegates (G5)."""
    in_use = {id(lm.model.model) for lm in loaded if not lm.is_dead() and lm.model is not None}
    rt.keep.release([lm.model for lm in removed if lm.model is not None])  # ComfyUI dropped them: so do we
    for lm in removed:
        patcher = lm.model
        if patcher is None:
            continue
        # G5: a Hook delegate unloaded, or its owner: the owner's cached legacy copy goes (ComfyUI loads the
        # delegate in place of its owner, so the owner itself may never have been loaded)
        rt.delegates.drop(patcher)
        if getattr(patcher, "non_dynamic_delegate_model", None) is not None:
            patcher.non_dynamic_delegate_model = None  # G5: the legacy second copy goes with its owner
        if id(patcher.model) in in_use:
            continue  # a clone still loaded shares this nn.Module and its reservation
        for v in _vbars_of(patcher):
            rt.unload_vbar(v, "unloaded by ComfyUI", earlier=max(0, sizes.get(id(v), 0) - v.loaded_size()))
