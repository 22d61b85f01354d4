"""The built-in scenarios: one per seed report, with the report's sizes, order and figures, and the
run-to-run guard (the same workflow run three times, another workflow between runs 2 and 3).

Each scenario builds its workload as trace events (the same events ``MEMBACKEND_TRACE``
records, see ``docs/trace-format.md``) for a seed, names the simulated profile it runs on, the
platform plugin that fixes it, the figures the report gave, and the guarantee the plugin side
must hold. Sizes and orders come from the public reports; where a report gives no figure
(a copy rate, a compute time) the assumption is stated next to it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from ..._settings.rules import did_you_mean, quoted
from ...types import _UnknownScenario as UnknownScenario

__all__ = ["Scenario", "SCENARIOS", "get_scenario", "UnknownScenario", "layered_run"]

MiB, GiB, GB = 1 << 20, 1 << 30, 10**9


@dataclass(frozen=True)
class Scenario:
    """A seed report turned into a replayable workload.

    ``build(seed)`` returns ``(events, machine)``: the workload's trace events and the profile
    fields this seed draws (``open_sim_variant`` keywords, e.g. ``pagein_seconds``).
    ``reported`` maps a figure's key (see ``engine.FIGURES`` and ``key_figures``) to what the
    report said. ``key_figures(side)`` adds the scenario's own rows: ``(key, label, value)``.
    ``plugin_holds(side)`` lists the guarantees the plugin side broke (empty: held);
    ``stock_reproduces(side)`` says whether the stock side shows the reported failure.
    """

    name: str
    report: str
    title: str
    profile: str
    plugin: str | None  # the backend that fixes it on ``profile``; None: whatever membackend selects
    guarantee: str
    build: Callable[[int], tuple[list[dict[str, Any]], dict[str, Any]]]
    reported: dict[str, str]
    key_figures: Callable[[Any], list[tuple[str, str, Any]]]
    plugin_holds: Callable[[Any], list[str]]
    stock_reproduces: Callable[[Any], bool]
    machine: dict[str, Any] = field(default_factory=dict)  # profile fields every seed changes
    default_seeds: int = 1


def layered_run(model: str, size: int, device: str, layer: int, copy_rate: float,
                compute: Callable[[int], float] | None = None, unpin: bool = True) -> list[dict[str, Any]]:
    """One model's pass as ComfyUI's dynamic loader makes it: per layer, fault it, copy its weights
    (``bytes / copy_rate`` seconds), compute, unpin. ``compute(step)`` gives each layer's compute
    seconds (none when None); ``unpin=False`` keeps the pages pinned (memory a plain, non-dynamic
    model holds for its whole life)."""
    events: list[dict[str, Any]] = []
    for step, offset in enumerate(range(0, size, layer)):
        n = min(layer, size - offset)
        span = {"model": model, "device": device, "offset": offset, "bytes": n}
        events.append({"event": "fault", **span})
        events.append({"event": "copy", **span, "seconds": n / copy_rate})
        if compute is not None:
            events.append({"event": "compute", "seconds": compute(step)})
        if unpin:
            events.append({"event": "unpin", **span})
    return events


def _register(model: str, size: int, devices: list[str], kind: str = "other", owner: str | None = None):
    return {"event": "register", "model": model, "bytes": size, "devices": devices, "kind": kind, "owner": owner}


def _use(*models: str, workflow: str | None = None):
    return {"event": "use", "models": list(models), "workflow": workflow}


# --------------------------------------------------------------------------- #15993 full-unload-rocm

#: ComfyUI #15993's set (a Krea2 workflow): bytes per model, one reservation per visible device
ROCM_MODELS = (("text_encoder", 5 * GB, "text_encoder"), ("unet", 12 * GB, "diffusion"), ("vae", 3 * 10**8, "vae"))
ROCM_COPY = 25e9  # bytes/s: the profile's host-to-device copy rate (PCIe 4.0 x16 class)


def _rocm_build(seed: int):
    devices = ["hip:0", "hip:1"]  # --cuda-device all: a ModelVBAR per device
    events = [_register(name, size, devices, kind) for name, size, kind in ROCM_MODELS]
    for name, size, _ in ROCM_MODELS:
        events.append(_use(name, workflow="krea2"))
        events += layered_run(name, size, "hip:0", 256 * MiB, ROCM_COPY)
    events += [{"event": "full_unload", "model": name} for name, _, _ in ROCM_MODELS]  # unload_all_models
    events.append({"event": "idle"})  # the prompt queue is empty
    return events, {}


def _rocm_key(side) -> list[tuple[str, str, Any]]:
    last = side.unloads[-1] if side.unloads else {}
    return [("committed_after_unload", "committed after unload, above the start (GB)",
             None if last.get("committed") is None else (last["committed"] - side.committed_start) / GB)]


def _rocm_holds(side) -> list[str]:
    """G1 after the run's unloads (nothing to check when the run never unloaded)."""
    if not side.unloads:
        return []
    out = []
    if side.alive_after_unload:
        out.append(f"G1: {side.alive_after_unload} reservation(s) alive after the full unload")
    if side.committed_end is not None and side.committed_end != side.committed_start:
        out.append(f"G1: committed {side.committed_end - side.committed_start:,} bytes above the start after unload")
    return out


def _rocm_reproduces(side) -> bool:
    return side.alive_after_unload > 0 and (side.committed_end or 0) > side.committed_start


# --------------------------------------------------------------------------- #15533 hook-unload

HOOK_CARD = 24 * GiB  # the report's 24 GiB card
HOOK_HELD = int(20.96 * GiB)  # what the retained Hook delegate held after unload (the report's figure)
HOOK_UNET = int(10.48 * GiB)  # the model the Hook patches (half of what the delegate held: weights + backup)
HOOK_VAE = int(3.5 * GiB)  # the VAE with its decode working set (regular decode OOMed at 3.04 GiB free)
HOOK_COPY = 25e9


def _hook_build(seed: int):
    d = ["cuda:0"]
    events = [_register("unet", HOOK_UNET, d, "diffusion"),
              _register("unet/hook", HOOK_HELD, d, "hook_delegate", owner="unet"),
              _use("unet", "unet/hook", workflow="hook lora")]
    # the plain delegate holds its weights for its whole life (ordinary allocations: never unpinned)
    events += layered_run("unet/hook", HOOK_HELD, "cuda:0", 256 * MiB, HOOK_COPY, unpin=False)
    for _ in range(2):  # two sampling steps stream the UNet through what is left
        events += layered_run("unet", HOOK_UNET, "cuda:0", 256 * MiB, HOOK_COPY)
    events += [{"event": "full_unload", "model": "unet"},  # the VAE load unloads the sampler's model
               _register("vae", HOOK_VAE, d, "vae"), _use("vae", workflow="vae decode")]
    # the VAE is not a dynamic model: weights and decode working set must be resident at once
    events += layered_run("vae", HOOK_VAE, "cuda:0", HOOK_VAE, HOOK_COPY)
    events += [{"event": "unload_all"}, {"event": "idle"}]
    return events, {}


def _vae_ooms(side) -> int:
    return side.oom_by_model.get("vae", 0)


def _hook_key(side) -> list[tuple[str, str, Any]]:
    first = side.unloads[0] if side.unloads else {}
    return [("held_after_owner_unload", "resident after the owner's unload (GB)*",
             None if "resident" not in first else first["resident"] / GB),
            ("vae_oom", "VAE faults out of memory", _vae_ooms(side))]


def _hook_holds(side) -> list[str]:
    out = []
    first = side.unloads[0] if side.unloads else {}
    if first.get("resident"):
        out.append(f"G5: {first['resident']:,} bytes still resident after the owner's full unload")
    if _vae_ooms(side):
        out.append(f"G5: the VAE load that follows ran out of memory {_vae_ooms(side)} time(s)")
    return out + _rocm_holds(side)


def _hook_reproduces(side) -> bool:
    first = side.unloads[0] if side.unloads else {}
    return first.get("resident", 0) >= HOOK_HELD and _vae_ooms(side) > 0


# --------------------------------------------------------------------------- #16246 churn-wddm

#: ComfyUI #16246's order: the LTX-video staging evicted, then the two models loaded after it
WDDM_MODELS = (("ltx_video", 20 * GB), ("z_image_text_encoder", int(7.7 * GB)), ("lumina2", int(11.7 * GB)))


def _wddm_build(seed: int):
    """Per seed: WDDM page-in 1-40 ms (a 6 GB card's VidMm paging an allocation in), copies at
    3-25 GB/s (a busy PCIe 3.0 x8 RTX 3050 up to PCIe 4.0 x16), the host 0-30 ms ahead per layer."""
    rng = random.Random(seed)
    pagein, rate = rng.uniform(0.001, 0.040), rng.uniform(3e9, 25e9)
    ahead = [rng.uniform(0.0, 0.030) for _ in range(64)]
    events = [_register(name, size, ["cuda:0"]) for name, size in WDDM_MODELS]
    for name, size in WDDM_MODELS:
        events.append(_use(name, workflow=name))
        events += layered_run(name, size, "cuda:0", 256 * MiB, rate, lambda step: ahead[step % len(ahead)])
    events += [{"event": "unload_all"}, {"event": "idle"}]
    return events, {"pagein_seconds": pagein, "copy_bandwidth": rate}


def _wddm_holds(side) -> list[str]:
    out = []
    if side.bugchecks:
        out.append(f"G2: {side.bugchecks} simulated bugcheck(s): a free or release raced a page-in or copy")
    if side.spilled:
        out.append(f"G3: {side.spilled:,} bytes spilled past the WDDM budget to shared memory")
    return out + _rocm_holds(side)


# --------------------------------------------------------------------------- #14519 mixed-warmup-gb10

GB10_WORKFLOWS = {
    "image": (("image_unet", 12 * GB), ("image_text_encoder", 7_500_000_000), ("image_vae", 500_000_000)),
    "video": (("video_unet", 32 * GB), ("video_text_encoder", 12 * GB), ("video_vae", 1 * GB)),
    "audio": (("audio_model", 6 * GB), ("audio_text_encoder", 2 * GB)),
}
GB10_ORDER = ("image", "video", "audio", "image", "video", "image")  # warm-up, then image -> video -> image
GB10_WARM = 9.0  # seconds: the report's warm image run, taken as every run's compute time
#: bytes/s a model loads at: the report's cold image run (~120 s) minus its warm run (~9 s) for the image set
GB10_LOAD_RATE = sum(s for _, s in GB10_WORKFLOWS["image"]) / (120.0 - GB10_WARM)


def _gb10_build(seed: int):
    events = [_register(n, s, ["cuda:0"]) for models in GB10_WORKFLOWS.values() for n, s in models]
    for workflow in GB10_ORDER:
        models = GB10_WORKFLOWS[workflow]
        events.append(_use(*(n for n, _ in models), workflow=workflow))
        for n, s in models:
            events += layered_run(n, s, "cuda:0", 1 * GiB, GB10_LOAD_RATE)
        events.append({"event": "compute", "seconds": GB10_WARM})
    events += [{"event": "unload_all"}, {"event": "idle"}]
    return events, {}


def _last_run(side, workflow: str):
    runs = [r for r in side.runs if r["workflow"] == workflow]
    return runs[-1] if runs else None


def _gb10_key(side) -> list[tuple[str, str, Any]]:
    last = _last_run(side, "image")
    return [("second_image_run_seconds", "image run after video, modelled (s)*", last and last["seconds"]),
            ("second_image_run_loaded", "bytes loaded by that run (GB)", last and last["loaded"] / GB)]


def _gb10_holds(side) -> list[str]:
    last = _last_run(side, "image")
    out = []
    if last is None:
        out.append("G4: no image run to check (the trace has none)")
    elif last["loaded"]:
        out.append(f"G4: the image run after video loaded {last['loaded']:,} bytes again")
    return out + _rocm_holds(side)


def _gb10_reproduces(side) -> bool:
    last = _last_run(side, "image")
    return last is not None and last["loaded"] > 0


def _apu_key(side) -> list[tuple[str, str, Any]]:
    return _gb10_key(side) + [("streamed_layers", "layers streamed (no memory for them)", side.oom)]


def _apu_reproduces(side) -> bool:
    """The image run after video slow again: reloaded, or streamed for want of memory (ROCm 7.2 keeps the
    memory stock's frees give back until the ranges are freed)."""
    last = _last_run(side, "image")
    return last is not None and (last["loaded"] > 0 or last["seconds"] > 2 * GB10_WARM)


# --------------------------------------------------------------------------- run-to-run

#: the workflow run three times (a Flux-class text-to-image set: T5-XXL fp16, the fp16 transformer, its VAE)
#: and the one run between runs 2 and 3 (an SDXL set); both fit a 141 GB H200 together
RUN_TO_RUN = {"txt2img": (("t5xxl_text_encoder", int(9.79 * GB)), ("flux_transformer", int(23.8 * GB)),
                          ("flux_vae", 167_666_902)),
              "sdxl": (("sdxl_unet", int(5.14 * GB)), ("sdxl_clip", int(1.62 * GB)), ("sdxl_vae", 167_335_342))}
RUN_TO_RUN_ORDER = ("txt2img", "txt2img", "sdxl", "txt2img")
RUN_TO_RUN_COPY = 25e9  # bytes/s host to device (PCIe 4.0 x16 class); a report gives none
RUN_TO_RUN_STEP = 2.0  # seconds of compute per run (sampling), the same on both sides


def _run_label(n: int, workflow: str) -> str:
    return f"{workflow} #{n}"


def _run_to_run_labels() -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for workflow in RUN_TO_RUN_ORDER:
        seen[workflow] = seen.get(workflow, 0) + 1
        out.append(_run_label(seen[workflow], workflow))
    return out


def _run_to_run_build(seed: int):
    events = [_register(n, size, ["cuda:0"]) for models in RUN_TO_RUN.values() for n, size in models]
    for workflow, label in zip(RUN_TO_RUN_ORDER, _run_to_run_labels()):
        models = RUN_TO_RUN[workflow]
        events.append(_use(*(n for n, _ in models), workflow=label))  # a new prompt: ComfyUI's load_models_gpu
        for n, size in models:
            events += layered_run(n, size, "cuda:0", 256 * MiB, RUN_TO_RUN_COPY)
        events.append({"event": "compute", "seconds": RUN_TO_RUN_STEP})
        events.append({"event": "idle"})  # the prompt queue empties between runs
    events += [{"event": "unload_all"}, {"event": "idle"}]  # POST /free, as ComfyUI's Unload Models button
    return events, {}


def run_to_run_loaded(side) -> list[tuple[str, int | None]]:
    """``(run label, bytes that run loaded)`` for every run of the scenario, in order (None: it did not run)."""
    by_label = {r["workflow"]: r["loaded"] for r in side.runs}
    return [(label, by_label.get(label)) for label in _run_to_run_labels()]


def _run_to_run_key(side) -> list[tuple[str, str, Any]]:
    return [(f"loaded_{label.replace(' #', '_')}", f"bytes loaded by {label} (GB)",
             None if loaded is None else loaded / GB) for label, loaded in run_to_run_loaded(side)]


def _run_to_run_holds(side) -> list[str]:
    """G4 run to run: every run of the repeated workflow after its first loads nothing (the budget allows)."""
    out = []
    for label, loaded in run_to_run_loaded(side)[1:]:
        if not label.startswith("txt2img"):
            continue
        if loaded is None:
            out.append(f"G4: {label} did not run")
        elif loaded:
            out.append(f"G4: {label} loaded {loaded:,} bytes again although every model fits the budget")
    return out + _rocm_holds(side)


def _run_to_run_reproduces(side) -> bool:
    return any(loaded for label, loaded in run_to_run_loaded(side)[1:] if label.startswith("txt2img"))


# --------------------------------------------------------------------------- AMD on Linux (issue 27)

#: the second-run-slower family on a discrete card (public reports, about 7 threads; one RX 7900 XT: a second run
#: 234 s with dynamic VRAM against 22 s without): a Flux-class set that fits a 24 GB card, run twice at 2048x2048,
#: whose VAE decode needs more working memory than the weights leave, so ComfyUI frees memory for it
#: (``free_memory``) once per run, before the decode
SECOND_RUN = (("t5xxl_fp8_text_encoder", 4_893_934_904), ("flux_dev_fp8_transformer", 11_901_517_824),
              ("flux_vae", 167_666_902))
SECOND_RUN_COPY = 25e9  # bytes/s host to device (PCIe 4.0 x16 class); the reports give none
SECOND_RUN_STEPS = 20  # sampling steps: every step runs the transformer's layers again
SECOND_RUN_STEP = 1.0  # seconds of compute per step, the same on both sides (about the 22 s the report measured
#                        without dynamic VRAM, with the encode and the decode)
SECOND_RUN_CARD = 24 * GiB  # rx7900xtx-linux
SECOND_RUN_LAYER = 512 * MiB
#: the decode's working memory as ComfyUI estimates it (comfy/sd.py, VAE.memory_used_decode: 2178 x the latent's
#: height x width x 64 x the dtype's size): a 256 x 256 latent (2048 x 2048 pixels) in bf16
SECOND_RUN_DECODE = 2178 * 256 * 256 * 64 * 2


def _second_run_build(seed: int):
    te, unet, vae = SECOND_RUN
    events = [_register(n, size, ["cuda:0"]) for n, size in SECOND_RUN]  # torch names a ROCm device cuda:0
    room = SECOND_RUN_DECODE - (SECOND_RUN_CARD - sum(size for _, size in SECOND_RUN))  # past what is free
    per_layer = SECOND_RUN_STEP / -(-unet[1] // SECOND_RUN_LAYER)
    for run in (1, 2):
        events.append(_use(te[0], unet[0], vae[0], workflow=f"txt2img #{run}"))
        events += layered_run(te[0], te[1], "cuda:0", SECOND_RUN_LAYER, SECOND_RUN_COPY)
        for _ in range(SECOND_RUN_STEPS):
            events += layered_run(unet[0], unet[1], "cuda:0", SECOND_RUN_LAYER, SECOND_RUN_COPY,
                                  compute=lambda step: per_layer)
        events.append({"event": "free_memory", "device": "cuda:0", "bytes": room})
        events += layered_run(vae[0], vae[1], "cuda:0", SECOND_RUN_LAYER, SECOND_RUN_COPY)
        events.append({"event": "idle"})
    events += [{"event": "unload_all"}, {"event": "idle"}]
    return events, {}


def _run_of(side, label: str):
    return next((r for r in side.runs if r["workflow"] == label), None)


def _second_run_key(side) -> list[tuple[str, str, Any]]:
    first, second = _run_of(side, "txt2img #1"), _run_of(side, "txt2img #2")
    return [("first_run_seconds", "first run, modelled (s)*", first and first["seconds"]),
            ("second_run_seconds", "second run, modelled (s)*", second and second["seconds"]),
            ("second_run_loaded", "bytes loaded by the second run (GB)", second and second["loaded"] / GB),
            ("streamed_layers", "layers streamed (no memory for them)", side.oom)]


def _second_run_holds(side) -> list[str]:
    first, second = _run_of(side, "txt2img #1"), _run_of(side, "txt2img #2")
    out = []
    if first is None or second is None:
        out.append("the trace has no second run to compare")
    elif second["seconds"] > first["seconds"] * 1.05:
        out.append(f"the second run took {second['seconds']:.1f} s, the first {first['seconds']:.1f} s")
    if side.oom:
        out.append(f"{side.oom} layer(s) streamed: no memory for them although the run fits the card by turns")
    return out + _rocm_holds(side)


def _second_run_reproduces(side) -> bool:
    """The second run slower than the first by more than a quarter, layers streamed: the reports' shape (how
    many times slower depends on the copy rate of streamed layers, which no report gives)."""
    first, second = _run_of(side, "txt2img #1"), _run_of(side, "txt2img #2")
    return (first is not None and second is not None and second["seconds"] > 1.25 * first["seconds"]
            and side.oom > 0)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        name="full-unload-rocm", report="ComfyUI #15993",
        title="Windows ROCm, 2 GPUs: a fully unloaded model keeps its reservation",
        profile="rocm-win-2gpu", plugin="rocm_windows", guarantee="G1",
        build=_rocm_build,
        reported={"committed_after_unload": "34.25 GB stock (41.58 GB private bytes, 7.33 GB when released)",
                  "alive_after_unload": "one per model and device (the ModelVBAR stays in dynamic_vbars)"},
        key_figures=_rocm_key, plugin_holds=_rocm_holds, stock_reproduces=_rocm_reproduces),
    Scenario(
        name="hook-unload", report="ComfyUI PR #15533",
        title="Hook LoRA on a 24 GB card: the delegate survives its owner's unload",
        profile="h200", plugin=None, guarantee="G5", machine={"device_memory": HOOK_CARD},
        build=_hook_build,
        reported={"held_after_owner_unload": "22.51 GB (the report's 20.96 GiB) still allocated on a 24 GB card (*the delegate is "
                                             "sized as this; what is measured is whether it stays)",
                  "vae_oom": "VAE decode out of memory (regular and tiled); '0 models unloaded'"},
        key_figures=_hook_key, plugin_holds=_hook_holds, stock_reproduces=_hook_reproduces),
    Scenario(
        name="churn-wddm", report="ComfyUI #16246",
        title="Windows CUDA (WDDM), 6 GB: allocate/free churn while pages are paged in",
        profile="wddm-6gb", plugin="cuda_wddm", guarantee="G2",
        build=_wddm_build,
        reported={"bugchecks": "4 bugchecks in a day (aimdo 0.5.3); 0 in 116 prompts / 12 h before (aimdo 0.4.15)"},
        key_figures=lambda side: [], plugin_holds=_wddm_holds, stock_reproduces=lambda side: side.bugchecks > 0,
        default_seeds=5),
    Scenario(
        name="mixed-warmup-gb10", report="ComfyUI #14519",
        title="GB10 unified memory: image -> video -> image reloads everything",
        profile="gb10-128gb", plugin="unified_gb10", guarantee="G4",
        build=_gb10_build,
        reported={"second_image_run_seconds": "~120 s stock, ~9 s warm (*the load rate and compute time "
                                              "are calibrated on these; what is measured is what reloads)",
                  "second_image_run_loaded": "everything reloaded (stock)"},
        key_figures=_gb10_key, plugin_holds=_gb10_holds, stock_reproduces=_gb10_reproduces),
    Scenario(
        name="run-to-run", report="ComfyUI users: the second run is slower than the first",
        title="The same workflow three times, another between runs 2 and 3: what each run loads",
        profile="h200", plugin=None, guarantee="G4",
        build=_run_to_run_build,
        reported={"loaded_txt2img_3": "users: the run after a workflow switch loads its models again (stock); "
                                      "every model fits the budget, so nothing needs to"},
        key_figures=_run_to_run_key, plugin_holds=_run_to_run_holds, stock_reproduces=_run_to_run_reproduces),
    Scenario(
        name="second-run-rocm", report="ComfyUI users on Linux ROCm: the second run is several times slower",
        title="Linux ROCm 7.2, 24 GB card: the second run of the same workflow is slower than the first",
        profile="rx7900xtx-linux", plugin="rocm_linux", guarantee="G4",
        build=_second_run_build,
        reported={"second_run_seconds": "234 s with dynamic VRAM, 22 s without (RX 7900 XT; *compute is "
                                        "calibrated on the 22 s, copies at 25 GB/s: what is measured is the "
                                        "ratio and what streams)"},
        key_figures=_second_run_key, plugin_holds=_second_run_holds, stock_reproduces=_second_run_reproduces),
    Scenario(
        name="mixed-apu", report="ComfyUI #14519's shape on Strix Halo",
        title="Strix Halo (128 GB, one pool): image -> video -> image reloads everything",
        profile="strix-halo-128gb", plugin="rocm_linux", guarantee="G4",
        build=_gb10_build,
        reported={"second_image_run_seconds": "GB10: ~120 s stock, ~9 s warm (the same workflows and rates on "
                                              "AMD's pool; no AMD figure is public)",
                  "second_image_run_loaded": "everything reloaded (stock)"},
        key_figures=_apu_key, plugin_holds=_gb10_holds, stock_reproduces=_apu_reproduces),
)}


def get_scenario(name: str) -> Scenario:
    """The built-in scenario ``name``; :class:`UnknownScenario` quoting the name (cut short), with the closest
    built-in one and every one's name."""
    try:
        return SCENARIOS[name]
    except (KeyError, TypeError):
        raise UnknownScenario(f"no built-in scenario {quoted(name)}{did_you_mean(name, SCENARIOS)}; built in: "
                              f"{', '.join(SCENARIOS)} (or give the path of a trace file)") from None
