"""Weights through membackend in a real ComfyUI: models, workflows and one served run per backend.

Everything here runs in the real tree's own Python (:class:`harness.ComfyPython`), in children:

* :func:`build_models` -- random-weight models made with ComfyUI's own classes, the same bytes every time:
  an SD1 ``AutoencoderKL`` (``models/vae``; the TAESD is the harness's, :func:`harness.build_vae`), an
  SD1.5-shaped checkpoint (``models/checkpoints``: ComfyUI's ``UNetModel`` with SD1.5's channels, context and heads but one res block per level, so that a
  run stays in minutes on two cores; ComfyUI's own detection reads it as ``SD15``; CLIP-L; the SD1 VAE;
  stored in fp16, as SD1.5 checkpoints are, so ComfyUI's cast path runs) and a LoRA on the UNet's attention
  (``models/loras``) for the Hook seed, with the checkpoint again in fp32 (:data:`CHECKPOINT_FP32`).
* :func:`run_weights` -- one served configuration: ComfyUI with ``--cpu --enable-dynamic-vram`` and the test
  shim (:mod:`.cpu_shim`) that lifts ComfyUI's explicit CPU checks on its dynamic path, so that ComfyUI's own
  ``ModelPatcherDynamic`` and cast path carry every weight through membackend's backend (a simulated GPU that
  holds real bytes, or the host). It runs the workflows, a second time with other seeds, again under a live
  headroom below the models' size, then ``POST /free``, reading ``/membackend/status`` between the phases.
  Every run, stock's too, has :data:`COMMON`'s flags.
* :func:`run_stock` -- the same workflows in the tree without membackend under ``--cpu``: the reference.

Nothing is downloaded; the models go into one folder the trees read through ``extra_model_paths.yaml``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from . import harness

SHIM = Path(__file__).resolve().parent / "cpu_shim.py"
CHECKPOINT = "membackend_test_sd15.safetensors"
#: the same checkpoint in fp32, for the Hook seed: ComfyUI samples it with a legacy (non-dynamic) delegate, which
#: on the CPU computes in fp32 from weights it does not cast (a GPU would compute SD1.5 in fp16)
CHECKPOINT_FP32 = "membackend_test_sd15_fp32.safetensors"
SD1_VAE = "membackend_test_sd1_vae.safetensors"
LORA = "membackend_test_lora.safetensors"
PROMPT_TIMEOUT = 600  # seconds for one workflow on a loaded two-core machine (the first load included)

#: the backends the weights suite serves: configuration name -> (environment, the backend expected to run)
BACKENDS: dict[str, tuple[dict[str, str], str]] = {
    # host: a capacity, so that its budget (and the streamed phase's room) is not the machine's MemAvailable,
    # which other processes move while the run goes on
    "host": ({"MEMBACKEND_BACKEND": "host", "MEMBACKEND_HOST_CAPACITY": "16GiB"}, "host"),
    "vmm/h200": ({"MEMBACKEND_SIM_PROFILE": "h200"}, "vmm"),
    "cuda_wddm/wddm-6gb": ({"MEMBACKEND_SIM_PROFILE": "wddm-6gb"}, "cuda_wddm"),
    "unified_gb10/gb10-128gb": ({"MEMBACKEND_SIM_PROFILE": "gb10-128gb"}, "unified_gb10"),
    "rocm_windows/rocm-win-2gpu": ({"MEMBACKEND_SIM_PROFILE": "rocm-win-2gpu"}, "rocm_windows"),
    # AMD on Linux (ROCm 7.2: memory returns only when a range is freed), an APU's one pool and RDNA4's 2 MiB
    **{f"rocm_linux/{p}": ({"MEMBACKEND_SIM_PROFILE": p}, "rocm_linux")
       for p in ("strix-halo-128gb", "rx7900xtx-linux", "rx9070xt-linux")},
}

MODELS_CHILD = r"""if True:
    import json, os, sys
    tree, out, vae_name, ckpt_name, lora_name, ckpt32_name = sys.argv[1:7]
    sys.path.insert(0, tree)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    from safetensors.torch import save_file
    import comfy.ops
    import comfy.sd1_clip
    import comfy.ldm.models.autoencoder as autoencoder
    import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel
    import comfy.model_detection

    def filled(sd, seed):
        # ComfyUI's layers skip weight initialisation: every tensor is drawn here, from one seeded generator,
        # scaled so that activations stay finite through the network (norm weights near 1)
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, t in sorted(sd.items()):
            shape = tuple(t.shape)
            if "position_ids" in name:
                v = t.clone()
            elif name in ("vae_scale", "vae_shift"):
                v = torch.tensor(1.0 if name == "vae_scale" else 0.0)
            elif t.dim() > 1:
                v = torch.randn(shape, generator=gen) * (1.0 / t[0].numel()) ** 0.5
            elif name.endswith("weight") and ("norm" in name or "ln" in name):
                v = 1.0 + 0.01 * torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) * 0.01
            out[name] = v.contiguous()
        return out

    os.makedirs(os.path.join(out, "vae"), exist_ok=True)
    os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
    os.makedirs(os.path.join(out, "loras"), exist_ok=True)
    sizes = {}

    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    vae = filled(autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=4).state_dict(), 3)
    save_file({k: v.float() for k, v in vae.items()}, os.path.join(out, "vae", vae_name))

    n = 1  # res blocks per level (SD1.5 has 2): the same path, about two thirds of the weights
    unet = openaimodel.UNetModel(
        image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[n] * 4,
        channel_mult=[1, 2, 4, 4], num_heads=8, use_spatial_transformer=True, transformer_depth=[1] * 3 * n + [0] * n,
        transformer_depth_middle=1, context_dim=768, use_linear_in_transformer=False, legacy=False,
        transformer_depth_output=[1] * 3 * (n + 1) + [0] * (n + 1), operations=comfy.ops.disable_weight_init)
    usd = filled(unet.state_dict(), 1)
    del unet
    clip = filled(comfy.sd1_clip.SDClipModel(device="cpu").state_dict(), 2)
    ckpt = {**{"model.diffusion_model." + k: v for k, v in usd.items()},
            **{"cond_stage_model." + k: v for k, v in clip.items()},
            **{"first_stage_model." + k: v for k, v in vae.items()}}
    if ckpt32_name:  # "" leaves it out: only the Hook seed reads it, and it is twice the fp16 file's size
        save_file({k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in ckpt.items()},
                  os.path.join(out, "checkpoints", ckpt32_name))
    ckpt = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in ckpt.items()}
    detected = comfy.model_detection.model_config_from_unet(ckpt, "model.diffusion_model.")
    save_file(ckpt, os.path.join(out, "checkpoints", ckpt_name))

    # a LoRA of rank 4 on every attention projection of the UNet, in ComfyUI's "lora_unet_" key format
    gen = torch.Generator().manual_seed(4)
    lora = {}
    for k, v in sorted(usd.items()):
        if v.dim() == 2 and any(p in k for p in (".attn1.to_", ".attn2.to_")) and k.endswith(".weight"):
            key = "lora_unet_" + k[:-len(".weight")].replace(".", "_")
            lora[key + ".lora_down.weight"] = (torch.randn((4, v.shape[1]), generator=gen) * 0.05).half()
            lora[key + ".lora_up.weight"] = (torch.randn((v.shape[0], 4), generator=gen) * 0.05).half()
            lora[key + ".alpha"] = torch.tensor(4.0)
    save_file(lora, os.path.join(out, "loras", lora_name))
    print(json.dumps({"detected": type(detected).__name__ if detected is not None else None,
                      "unet_params": sum(v.numel() for v in usd.values()),
                      "clip_params": sum(v.numel() for v in clip.values()),
                      "vae_params": sum(v.numel() for v in vae.values()), "lora_tensors": len(lora)}))
"""


def build_models(folder: Path, *, tree: Path, python: harness.ComfyPython) -> dict[str, Any]:
    """The test models in ``folder`` (see the module docstring); returns what was built. The same bytes on
    every call; the checkpoint must be detected by ComfyUI as SD1.5 (:class:`harness.HarnessError` if not)."""
    folder.mkdir(parents=True, exist_ok=True)
    p = harness.run_child([python.path, "-c", MODELS_CHILD, str(tree), str(folder), SD1_VAE, CHECKPOINT, LORA,
                           CHECKPOINT_FP32], cwd=tree, timeout=900)
    built = json.loads(p.stdout.strip().splitlines()[-1])
    if built.get("detected") != "SD15":
        raise harness.HarnessError(f"ComfyUI reads the test checkpoint as {built.get('detected')}, not SD15: {built}")
    return built


def model_paths(tree: Path, folder: Path) -> None:
    """Point ``tree`` at the shared model folder (ComfyUI reads ``extra_model_paths.yaml`` at start-up)."""
    (tree / "extra_model_paths.yaml").write_text(
        f"membackend_tests:\n  base_path: {folder}\n  checkpoints: checkpoints\n  vae: vae\n  loras: loras\n",
        encoding="utf-8")


# ---------------------------------------------------------------------------------------------- workflows

def colour(seed: int) -> int:
    """An image colour per seed, so that a VAE workflow with another seed runs again (ComfyUI would answer an
    identical prompt from its cache without running a node)."""
    return (0x3366CC + 0x1F2F3F * seed) & 0xFFFFFF


def vae_roundtrip(vae_name: str, seed: int, prefix: str, size: int = 64) -> dict[str, Any]:
    """``EmptyImage`` (the seed's colour) -> ``vae_name``'s encode and decode -> ``SaveImage``."""
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": size, "height": size, "batch_size": 1,
                                                          "color": colour(seed)}},
            "2": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
            "3": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["2", 0]}},
            "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["2", 0]}},
            "5": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": prefix}}}


def txt2img_workflow(seed: int, prefix: str = "mb_txt2img", steps: int = 3, hook_lora: bool = False,
                     checkpoint: str = CHECKPOINT) -> dict[str, Any]:
    """The checkpoint sampled ``steps`` Euler steps at 64x64 from ``seed`` (at denoise 1.0, from the latent of
    an image its own VAE encoded, so that every layer of every model of the checkpoint runs), decoded by its
    VAE. ``hook_lora``: the prompt's CLIP carries a Hook LoRA (``CreateHookLora`` -> ``SetClipHooks``), so
    ComfyUI samples with the model's non-dynamic delegate (``CFGGuider.inner_set_conds``)."""
    wf: dict[str, Any] = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a photograph of a lighthouse", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "10": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0x808080}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["1", 2]}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "seed": seed, "steps": steps, "cfg": 7.0,
                                                   "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": prefix}},
    }
    if hook_lora:
        wf["8"] = {"class_type": "CreateHookLora", "inputs": {"lora_name": LORA, "strength_model": 1.0,
                                                               "strength_clip": 0.0}}
        wf["9"] = {"class_type": "SetClipHooks", "inputs": {"clip": ["1", 1], "apply_to_conds": True,
                                                            "schedule_clip": False, "hooks": ["8", 0]}}
        wf["2"]["inputs"]["clip"] = ["9", 0]
    return wf


#: the weights suite's workflows: name -> the workflow for a seed
WORKFLOWS: dict[str, Callable[[int], dict[str, Any]]] = {
    "taesd": lambda seed: vae_roundtrip(harness.VAE_NAME, seed, "mb_taesd"),
    "sd1-vae": lambda seed: vae_roundtrip(SD1_VAE, seed, "mb_sd1vae"),
    "txt2img": lambda seed: txt2img_workflow(seed),
}
#: the seeds of the three phases: each phase's prompts differ from the others', so ComfyUI runs their nodes
FIRST_SEED, SECOND_SEED, STREAMED_SEED = 1, 2, 3
#: ComfyUI's flags for every run of the suite, stock and membackend alike. An LRU cache of node results keeps
#: the loaders' models across prompts (the default RAM-pressure cache drops them when this 24 GiB machine runs
#: low, and ComfyUI then makes new models from the files, stock or not). PyTorch's attention, whose result does
#: not depend on the free memory: under the host backend the CPU is membackend's device, so ComfyUI's own
#: memory checks see membackend's budget, and the sub-quadratic attention ComfyUI picks on a CPU sizes its
#: chunks by that figure (a lowered headroom would change the last bits, stock or not)
COMMON = ("--cache-lru", "64", "--use-pytorch-cross-attention")
DYNAMIC_FLAGS = ("--cpu", "--enable-dynamic-vram", *COMMON)
STOCK_FLAGS = ("--cpu", *COMMON)
#: the streamed phase's room: this share of the pages every model's weights span. Below the models' size, so
#: they cannot all stay resident and are evicted and loaded again; above what ComfyUI's sampler asks of the
#: free memory to run the prompt's two conditionings in one batch, as stock does (calc_cond_batch)
STREAMED_ROOM = 0.75


# ---------------------------------------------------------------------------------------------- runs

def status(server: harness.Server) -> dict[str, Any]:
    code, st = server.get("/membackend/status")
    if code != 200 or not isinstance(st, dict):
        raise harness.HarnessError(f"GET /membackend/status answered {code}: {st}")
    return st


def committed(st: dict[str, Any]) -> dict[str, int]:
    """Per device, the memory its driver holds for the process (``kept[device].committed``)."""
    return {d: int(v.get("committed") or 0) for d, v in (st.get("kept") or {}).items()}


def weights_bytes(st: dict[str, Any]) -> int:
    """The weights membackend serves: the sum of every model's size (what ComfyUI staged in its VBAR)."""
    return sum(int(m.get("size") or 0) for m in (st.get("models") or {}).values())


def page_rounded(st: dict[str, Any], page: int) -> int:
    """The bytes of the pages every model's weights span (what faulting them all loads)."""
    return sum(-(-int(m.get("size") or 0) // page) * page for m in (st.get("models") or {}).values())


def rss(server: harness.Server) -> int:
    """The server process's resident memory (``VmRSS``), in bytes."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_all(server: harness.Server, timeout: float = harness.FREE_TIMEOUT * 3) -> tuple[dict[str, Any], float]:
    """``POST /free`` (unload every model, free memory); the status once no reservation and no model is left
    (or at the timeout), and how long that took. A model's reservation goes with ComfyUI's unload, the model
    itself when the garbage collector takes its ModelVBAR and the reaper thread retires it: a status between
    the two lists it, not resident, with no reservation."""
    code, answer = server.post("/free", {"unload_models": True, "free_memory": True})
    if code != 200:
        raise harness.HarnessError(f"POST /free answered {code}: {answer}")
    t0 = time.monotonic()
    while True:
        st = status(server)
        if (st.get("reservations") == [] and not st.get("models")) or time.monotonic() - t0 > timeout:
            return st, round(time.monotonic() - t0, 2)
        time.sleep(0.25)


@dataclass
class Phase:
    """One phase of a weights run: the images' sha256 per workflow and what membackend loaded meanwhile."""

    hashes: dict[str, str] = field(default_factory=dict)
    loaded: int = 0  # bytes membackend's faults newly backed during the phase
    loads: list[str] = field(default_factory=list)  # the per-load lines' words of the phase
    evictions: int = 0  # models that lost pages during the phase (the status's "evictions" grew)
    seconds: float = 0.0
    faults: int = 0  # the facade's vbar_fault calls during the phase (ComfyUI's dynamic path, per weight per step)
    unpins: int = 0
    classic: list[str] = field(default_factory=list)  # the models on ComfyUI's classic path at the phase's end


@dataclass
class ServedRun:
    """What every served run of this module records: its configuration, the driver's counters at the end,
    the server's membackend lines and tracebacks, the error that stopped it, how long it took."""

    name: str
    env: dict[str, str]
    flags: tuple[str, ...]
    driver: dict[str, Any] = field(default_factory=dict)  # per device: hazards and API call counts at the end
    membackend_lines: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return asdict(self)

    def read_end(self, st: dict[str, Any]) -> None:
        """The driver's counters from the last status."""
        self.driver = {d: {"hazards": v.get("hazards"), "calls": v.get("calls")}
                       for d, v in (st.get("kept") or {}).items()}

    def read_log(self, log: Path, trees: harness.Trees) -> None:
        """The server's membackend lines and the exception ending each traceback in its log."""
        if log.is_file():
            out = log.read_text(encoding="utf-8", errors="replace")
            self.membackend_lines = harness.membackend_lines(out)
            self.exceptions = sorted(harness.exceptions(out, trees.scratch, trees.stock, trees.node).elements())


@dataclass
class WeightsRun(ServedRun):
    """What one served configuration of the weights suite gave (see :func:`run_weights`)."""

    backend: str | None = None
    state: str | None = None
    page_size: int = 0
    phases: dict[str, Phase] = field(default_factory=dict)
    weights: int = 0  # the weights' bytes of every model served (sum of their sizes)
    weights_pages: int = 0  # the pages those weights span
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # after the first phase: name -> size, resident
    headroom: int | None = None  # the live headroom of the streamed phase
    reservations_before_free: int | None = None
    reservations_after_free: list[Any] | None = None
    committed_start: dict[str, int] = field(default_factory=dict)
    committed_after_free: dict[str, int] = field(default_factory=dict)
    free_seconds: float | None = None


@contextlib.contextmanager
def shimmed(trees: harness.Trees, label: str, env: dict[str, str], flags: tuple[str, ...], *,
            python: harness.ComfyPython, log: Path) -> Iterator[harness.Server]:
    """A scratch copy of the node tree served with ``flags``, ``env`` and the CPU shim (:data:`SHIM`)."""
    with trees.scratch_copy(trees.node, label) as tree, \
            harness.serve(tree, flags, {**env, "REAL_COMFYUI_CPU_SHIM": str(SHIM)}, python=python, log=log) as server:
        yield server


def _phase(server: harness.Server, seed: int, workflows: dict[str, Callable[[int], dict[str, Any]]],
           before: dict[str, Any]) -> tuple[Phase, dict[str, Any]]:
    t0 = time.monotonic()
    ph = Phase()
    for name, make in workflows.items():
        images = server.run_prompt(make(seed), timeout=PROMPT_TIMEOUT)
        ph.hashes[name] = harness.sha256(images[0])
    after = status(server)
    ph.loaded = int(after.get("loaded_bytes", 0)) - int(before.get("loaded_bytes", 0))
    new = int(after.get("load_count", 0)) - int(before.get("load_count", 0))
    ph.loads = [f"{x.get('name')}: {x.get('text')}" for x in (after.get("loads") or [])[-new:]] if new else []
    ph.evictions = sum(1 for k, v in (after.get("evictions") or {}).items()
                       if (before.get("evictions") or {}).get(k) != v)
    ph.faults, ph.unpins = calls(after, before)
    ph.classic = sorted(m.get("name") for m in (after.get("models") or {}).values() if m.get("path") == "classic")
    ph.seconds = round(time.monotonic() - t0, 1)
    return ph, after


def _delta(after: dict[str, Any], before: dict[str, Any], group: str, key: str) -> int:
    return int((after.get(group) or {}).get(key, 0)) - int((before.get(group) or {}).get(key, 0))


def reads(after: dict[str, Any], before: dict[str, Any], which: str) -> int:
    """The weights' bytes read ``from_file`` into the device (or copied ``from_vram``) between two statuses."""
    return int((after.get("reads") or {}).get(which, 0)) - int((before.get("reads") or {}).get(which, 0))


def calls(after: dict[str, Any], before: dict[str, Any]) -> tuple[int, int]:
    """The facade's ``vbar_fault`` and ``vbar_unpin`` calls between two statuses."""
    a, b = after.get("calls") or {}, before.get("calls") or {}
    return (int(a.get("vbar_fault", 0)) - int(b.get("vbar_fault", 0)),
            int(a.get("vbar_unpin", 0)) - int(b.get("vbar_unpin", 0)))


def run_weights(name: str, env: dict[str, str], *, trees: harness.Trees, python: harness.ComfyPython, logs: Path,
                workflows: dict[str, Callable[[int], dict[str, Any]]] = WORKFLOWS,
                flags: tuple[str, ...] = DYNAMIC_FLAGS) -> WeightsRun:
    """Serve the node tree with ``env`` and the CPU shim; run the workflows from :data:`FIRST_SEED` (phase
    ``first``), from :data:`SECOND_SEED` (``second``), then with a live headroom that leaves
    :data:`STREAMED_ROOM` of the weights' pages of room, from :data:`STREAMED_SEED` (``streamed``); then
    ``POST /free``."""
    got = WeightsRun(name, env, flags)
    log = logs / f"weights-{harness.safe_name(name)}.log"
    t0 = time.monotonic()
    try:
        with shimmed(trees, f"weights-{name}", env, flags, python=python, log=log) as server:
            st = status(server)
            got.backend, got.state = st.get("backend"), st.get("state")
            got.committed_start = committed(st)
            first, st = _phase(server, FIRST_SEED, workflows, st)
            got.phases["first"] = first
            got.weights = weights_bytes(st)
            page = max(int(r.get("page_size") or 0) for r in st.get("reservations") or [{"page_size": 2 << 20}])
            got.page_size = page
            got.weights_pages = page_rounded(st, page)
            got.models = {m.get("name"): {"size": m.get("size"), "resident": m.get("resident")}
                          for m in (st.get("models") or {}).values()}
            second, st = _phase(server, SECOND_SEED, workflows, st)
            got.phases["second"] = second
            device = next(iter(st.get("budgets") or {"cuda:0": None}))
            b = st["budgets"][device]
            # leave room for part of the weights' pages: every model cannot stay resident, so they stream
            room = int(got.weights_pages * STREAMED_ROOM)
            used = int(b["total"]) - int(b["free"])
            resident = sum(int(m.get("resident") or 0) for m in (st.get("models") or {}).values())
            got.headroom = max(0, int(b["total"]) - (used - resident) - room)
            code, answer = server.post("/membackend/headroom", {"device": device, "headroom": got.headroom})
            if code != 200:
                raise harness.HarnessError(f"POST /membackend/headroom answered {code}: {answer}")
            streamed, st = _phase(server, STREAMED_SEED, workflows, status(server))
            got.phases["streamed"] = streamed
            got.reservations_before_free = len(st.get("reservations") or [])
            st, got.free_seconds = free_all(server)
            got.reservations_after_free = st.get("reservations")
            got.committed_after_free = committed(st)
            got.read_end(st)
    except (harness.HarnessError, OSError, ValueError, KeyError) as exc:
        got.error = str(exc) if isinstance(exc, harness.HarnessError) else f"{type(exc).__name__}: {exc}"
    got.read_log(log, trees)
    got.seconds = round(time.monotonic() - t0, 1)
    return got


@dataclass
class StockRun:
    """The reference: the images stock ComfyUI (no membackend) saves under ``--cpu``, per seed and workflow."""

    hashes: dict[int, dict[str, str]] = field(default_factory=dict)
    error: str | None = None
    exceptions: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return asdict(self)


def run_stock(*, trees: harness.Trees, python: harness.ComfyPython, logs: Path,
              workflows: dict[str, Callable[[int], dict[str, Any]]] = WORKFLOWS,
              seeds: tuple[int, ...] = (FIRST_SEED, SECOND_SEED, STREAMED_SEED)) -> StockRun:
    got = StockRun()
    log = logs / "weights-stock.log"
    t0 = time.monotonic()
    try:
        with trees.scratch_copy(trees.stock, "weights-stock") as tree, \
                harness.serve(tree, STOCK_FLAGS, {}, python=python, log=log) as server:
            for seed in seeds:
                got.hashes[seed] = {name: harness.sha256(server.run_prompt(make(seed), timeout=PROMPT_TIMEOUT)[0])
                                    for name, make in workflows.items()}
    except (harness.HarnessError, OSError, ValueError) as exc:
        got.error = str(exc)
    if log.is_file():
        got.exceptions = sorted(harness.exceptions(log.read_text(encoding="utf-8", errors="replace"),
                                                   trees.scratch, trees.stock, trees.node).elements())
    got.seconds = round(time.monotonic() - t0, 1)
    return got


# ---------------------------------------------------------------------------------------------- scripted runs

@dataclass
class Step:
    """What one step of a scripted run saw: its kind and label, the image's sha256 (a prompt), the status's
    figures after it, the server's resident memory, and the bytes membackend loaded during it."""

    kind: str
    label: str
    image: str | None = None
    loaded: int = 0
    loads: list[str] = field(default_factory=list)
    reservations: int = 0
    committed: dict[str, int] = field(default_factory=dict)
    peak_committed: dict[str, int] = field(default_factory=dict)  # the status history's highest, per device
    rss: int = 0
    evictions: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> size, resident after the step
    budget: dict[str, Any] = field(default_factory=dict)  # the first device's budget after the step
    delegates: list[dict[str, Any]] = field(default_factory=list)  # Hook delegates their owners still hold
    delegates_alive: int = 0  # Hook delegates' models anything still keeps alive
    answer: Any = None
    #: the status's models by id (each ModelVBAR has its own): name, state, resident bytes, ``held`` and ``path``
    by_id: dict[str, dict[str, Any]] = field(default_factory=dict)
    resident: int = 0  # the device's resident bytes after the step (the ledger's account)
    faults: int = 0  # the facade's vbar_fault calls during the step
    unpins: int = 0
    promoted: int = 0  # models put on ComfyUI's classic path during the step (issue 41, item 1)
    demoted: int = 0  # and put back on the dynamic path
    cached: int = 0  # bytes of dropped models' weights kept as cache after the step (issue 41, item 2)
    from_file: int = 0  # weights' bytes read from their file into the device during the step
    from_vram: int = 0  # weights' bytes copied on the device from VRAM that held them instead


@dataclass
class Scripted(ServedRun):
    """What one scripted run gave (see :func:`run_script`): the status at start-up and after each step."""

    start: Step | None = None
    steps: list[Step] = field(default_factory=list)

    def step(self, label: str) -> Step:
        return next(s for s in self.steps if s.label == label)


def _seen(kind: str, label: str, server: harness.Server, before: dict[str, Any], st: dict[str, Any]) -> Step:
    new = int(st.get("load_count", 0)) - int(before.get("load_count", 0))
    history = st.get("history") or {}
    return Step(kind, label, loaded=int(st.get("loaded_bytes", 0)) - int(before.get("loaded_bytes", 0)),
                loads=[f"{x.get('name')}: {x.get('text')}" for x in (st.get("loads") or [])[-new:]] if new else [],
                reservations=len(st.get("reservations") or []), committed=committed(st),
                peak_committed={d: max((int(x[3] or 0) for x in h), default=0) for d, h in history.items()},
                rss=rss(server),
                evictions=sum(1 for k, v in (st.get("evictions") or {}).items()
                              if (before.get("evictions") or {}).get(k) != v),
                models={m.get("name"): {"size": m.get("size"), "resident": m.get("resident")}
                        for m in (st.get("models") or {}).values()},
                budget=next(iter((st.get("budgets") or {}).values()), {}),
                delegates=list(st.get("delegates") or []), delegates_alive=int(st.get("delegates_alive") or 0),
                by_id={k: {"name": m.get("name"), "state": m.get("state"), "resident": m.get("resident"),
                           "held": m.get("held"), "path": m.get("path")} for k, m in (st.get("models") or {}).items()},
                resident=sum(int(m.get("resident") or 0) for m in (st.get("models") or {}).values()),
                faults=calls(st, before)[0], unpins=calls(st, before)[1],
                promoted=_delta(st, before, "classic", "promoted"), demoted=_delta(st, before, "classic", "demoted"),
                cached=sum(int(c.get("bytes") or 0) for c in (st.get("cache") or {}).values()),
                from_file=reads(st, before, "from_file"), from_vram=reads(st, before, "from_vram"))


def run_script(name: str, env: dict[str, str], script: list[tuple[str, str, Any]], *, trees: harness.Trees,
               python: harness.ComfyPython, logs: Path, flags: tuple[str, ...] = DYNAMIC_FLAGS) -> Scripted:
    """Serve the node tree with ``env`` and the CPU shim and run ``script``: ``(kind, label, arg)`` steps,
    ``prompt`` (arg: a workflow), ``headroom`` (arg: bytes for ``POST /membackend/headroom`` on the first
    device, or a function of the run so far that answers them), ``free`` (``POST /free`` unloading every
    model, then waiting for the reservations to go) or ``call`` (arg: a function run here, e.g. one that
    rewrites a model file)."""
    got = Scripted(name, env, flags)
    log = logs / f"script-{harness.safe_name(name)}.log"
    t0 = time.monotonic()
    try:
        with shimmed(trees, f"script-{name}", env, flags, python=python, log=log) as server:
            st = status(server)
            got.start = _seen("start", "start", server, st, st)
            device = next(iter(st.get("budgets") or {"cuda:0": None}))
            for kind, label, arg in script:
                before = status(server)
                image = answer = None
                if kind == "prompt":
                    image = harness.sha256(server.run_prompt(arg, timeout=PROMPT_TIMEOUT)[0])
                elif kind == "headroom":
                    if callable(arg):
                        arg = arg(got)
                    code, answer = server.post("/membackend/headroom", {"device": device, "headroom": arg})
                    if code != 200:
                        raise harness.HarnessError(f"POST /membackend/headroom answered {code}: {answer}")
                elif kind == "free":
                    st, answer = free_all(server)
                elif kind == "call":  # arg: a function of nothing, run here (a change to a model file)
                    answer = arg()
                else:
                    raise harness.HarnessError(f"unknown step kind {kind!r}")
                seen = _seen(kind, label, server, before, status(server))
                seen.image, seen.answer = image, answer
                got.steps.append(seen)
            got.read_end(status(server))
    except (harness.HarnessError, OSError, ValueError, KeyError, StopIteration) as exc:
        got.error = str(exc) if isinstance(exc, harness.HarnessError) else f"{type(exc).__name__}: {exc}"
    got.read_log(log, trees)
    got.seconds = round(time.monotonic() - t0, 1)
    return got


def clean_run(name: str, env: dict[str, str], script: list[tuple[str, str, Any]], *, trees: harness.Trees,
              python: harness.ComfyPython, report: harness.Report, flags: tuple[str, ...] = DYNAMIC_FLAGS) -> Scripted:
    """:func:`run_script`, its row in the report under ``name``; an error, a traceback in the server's log or
    the adapter switching itself off fails the calling test (its fixture) with what happened."""
    import pytest

    got = run_script(name, env, script, trees=trees, python=python, logs=report.folder / "logs", flags=flags)
    report.put(name, got.row())
    if got.error:
        pytest.fail(f"{name}: {got.error}", pytrace=False)
    assert not got.exceptions, f"tracebacks in the server's log: {got.exceptions}"
    assert not any("switched off" in line for line in got.membackend_lines), got.membackend_lines
    return got


def stock_images(workflows: list[dict[str, Any]], *, trees: harness.Trees, python: harness.ComfyPython,
                 logs: Path, label: str) -> list[str]:
    """The sha256 of the image each workflow saves in stock ComfyUI (no membackend) under :data:`STOCK_FLAGS`."""
    with trees.scratch_copy(trees.stock, f"stock-{label}") as tree, \
            harness.serve(tree, STOCK_FLAGS, {}, python=python, log=logs / f"stock-{harness.safe_name(label)}.log") \
            as server:
        return [harness.sha256(server.run_prompt(wf, timeout=PROMPT_TIMEOUT)[0]) for wf in workflows]


# ---------------------------------------------------------------------------------------------- the seed reports

#: a second backend on the WDDM profile for seed 002: the generic VMM backend, as a platform without the plugin
COMPARISONS: dict[str, tuple[dict[str, str], str]] = {
    "vmm/wddm-6gb": ({"MEMBACKEND_BACKEND": "vmm", "MEMBACKEND_SIM_PROFILE": "wddm-6gb"}, "vmm"),
}

def decode_cap(run: "Scripted") -> int:
    """Seed 001's headroom: room for the VAE the decode loads plus half of the UNet whose legacy copy the Hook
    delegate is, so that the decode fits only if the delegate went with its owner."""
    hook = run.step("hook")
    vae = max(int(m["size"]) for n, m in hook.models.items() if n.startswith("AutoencoderKL"))
    delegate = sum(int(d["bytes"]) for d in hook.delegates)
    b = run.step("free").budget
    return max(0, int(b["free"]) - (vae + 64 * 2**20 + delegate // 2))


#: ComfyUI's default node cache (RAM pressure: after each node, the results of earlier prompts are dropped, old
#: models first), everything else as :data:`DYNAMIC_FLAGS`
DEFAULT_CACHE_FLAGS = ("--cpu", "--enable-dynamic-vram", "--use-pytorch-cross-attention")

def lora_workflow(seed: int, prefix: str, checkpoint: str = CHECKPOINT_FP32) -> dict[str, Any]:
    """:func:`txt2img_workflow` with the test LoRA on the UNet (``LoraLoaderModelOnly``): ComfyUI's dynamic path
    writes each patched weight into its VBAR range after copying it in."""
    wf = txt2img_workflow(seed, prefix, checkpoint=checkpoint)
    wf["11"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": LORA,
                                                                  "strength_model": 1.0}}
    wf["5"]["inputs"]["model"] = ["11", 0]
    return wf


def rewrite(path: Path) -> str:
    """The file written again in place with the same bytes: the same inode and size, a new ``mtime_ns``."""
    data = path.read_bytes()
    before = path.stat().st_mtime_ns
    time.sleep(0.02)
    with open(path, "r+b") as f:
        f.write(data)
    if path.stat().st_mtime_ns == before:  # a coarse clock: move it on
        os.utime(path, ns=(time.time_ns(), before + 1_000_000))
    st = path.stat()
    return f"rewritten: inode {st.st_ino}, {st.st_size} bytes, mtime_ns {before} -> {st.st_mtime_ns}"


def replace(path: Path) -> str:
    """The file replaced by a copy of itself: the same bytes, size and ``mtime_ns``, another inode."""
    before = path.stat()
    other = path.with_name(path.name + ".new")
    shutil.copy2(path, other)
    os.replace(other, path)
    st = path.stat()
    return f"replaced: inode {before.st_ino} -> {st.st_ino}, mtime_ns {before.st_mtime_ns} -> {st.st_mtime_ns}"


def dropped_script(models: Path) -> list[tuple[str, str, Any]]:
    """Issue 41, item 2, under ComfyUI's default cache (a workflow with another model drops the checkpoint's
    models after its first node; the checkpoint's next prompt makes new models from the file): the checkpoint
    stored as the CPU computes it (fp32, so that every weight is read as it is stored, as SD1.5's fp16 weights
    are on a GPU); the SD1 VAE's workflow; the checkpoint again (read from VRAM); again after the file was
    rewritten (a new mtime), and after it was replaced (a new inode); with a LoRA on the UNet, then plain (the
    patched weights read anew); then a cap the cache alone makes room for, and ``POST /free``."""
    ckpt = models / "checkpoints" / CHECKPOINT_FP32

    def vae(seed: int) -> dict[str, Any]:
        return vae_roundtrip(SD1_VAE, seed, f"mb_drop_vae{seed}")

    return [
        ("prompt", "txt2img", txt2img_workflow(1, "mb_drop_a", checkpoint=CHECKPOINT_FP32)),
        ("prompt", "vae", vae(1)),
        ("prompt", "txt2img again", txt2img_workflow(2, "mb_drop_b", checkpoint=CHECKPOINT_FP32)),
        ("prompt", "vae 2", vae(2)),
        ("call", "rewrite", lambda: rewrite(ckpt)),
        ("prompt", "txt2img rewritten", txt2img_workflow(3, "mb_drop_c", checkpoint=CHECKPOINT_FP32)),
        ("prompt", "vae 3", vae(3)),
        ("call", "replace", lambda: replace(ckpt)),
        ("prompt", "txt2img replaced", txt2img_workflow(4, "mb_drop_d", checkpoint=CHECKPOINT_FP32)),
        ("prompt", "lora", lora_workflow(5, "mb_drop_e")),
        ("prompt", "vae 4", vae(4)),
        ("prompt", "txt2img after the lora", txt2img_workflow(6, "mb_drop_f", checkpoint=CHECKPOINT_FP32)),
        ("prompt", "vae 5", vae(5)),
        ("headroom", "cap", cache_cap),
        ("free", "free", None),
    ]


def unet_only_cap(run: "Scripted") -> int:
    """A headroom that leaves room for the UNet (``BaseModel``) resident now and 64 MiB more: what else is
    resident goes, and the VAE a decode then loads needs pages of the UNet."""
    last = run.steps[-1]
    b = last.budget
    unet = sum(int(m["resident"] or 0) for m in last.by_id.values() if m["name"] == "BaseModel")
    return int(b["free"]) + last.resident - unet - (64 << 20)


def sample_only_workflow(seed: int, prefix: str) -> dict[str, Any]:
    """:func:`txt2img_workflow` without its decode: the latent saved (``SaveLatent``), and an ``EmptyImage``
    saved beside it (so that the prompt saves an image). The UNet is the last model it uses."""
    wf = txt2img_workflow(seed, prefix)
    del wf["6"], wf["7"]
    wf["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}}
    wf["13"] = {"class_type": "SaveImage", "inputs": {"images": ["10", 0], "filename_prefix": prefix}}
    return wf


#: issue 41, item 1: warm prompts on ComfyUI's classic path; a prompt that uses the UNet last; then a cap with
#: room for the UNet alone (the least recently used models go), so that the next prompt's sampler runs the
#: UNet promoted and its VAE decode needs the UNet's pages: the UNet goes back to the dynamic path in the middle
#: of the prompt
CLASSIC: list[tuple[str, str, Any]] = [
    ("prompt", "cold", txt2img_workflow(FIRST_SEED, "mb_classic_a")),
    ("prompt", "warm", txt2img_workflow(SECOND_SEED, "mb_classic_b")),
    ("prompt", "sample only", sample_only_workflow(5, "mb_classic_s")),
    ("headroom", "cap", unet_only_cap),
    ("prompt", "under the cap", txt2img_workflow(STREAMED_SEED, "mb_classic_c")),
    ("prompt", "again under the cap", txt2img_workflow(4, "mb_classic_d")),
    ("free", "free", None),
]


def cache_cap(run: "Scripted") -> int:
    """A headroom that leaves room for what is resident now but the cache (one byte of it aside): the cache
    alone makes that room, and it goes whole model by whole model."""
    last = run.steps[-1]
    b = last.budget
    return int(b["free"]) + last.cached - 1

#: the seed reports as scripted runs: name -> (environment, extra ComfyUI flags, the script)
SEEDS: dict[str, tuple[dict[str, str], tuple[str, ...], list[tuple[str, str, Any]]]] = {
    # 000: Windows ROCm, two GPUs, smart memory off: a full unload returns private commit to its start-up value
    "000": ({"MEMBACKEND_SIM_PROFILE": "rocm-win-2gpu"}, ("--disable-smart-memory", "--cuda-device", "all"),
            [("prompt", "txt2img", txt2img_workflow(FIRST_SEED, "mb_s000")),
             ("prompt", "sd1-vae", vae_roundtrip(SD1_VAE, FIRST_SEED, "mb_s000_vae")),
             ("free", "free", None)]),
    # 001: the checkpoint without and with a Hook LoRA: with it, ComfyUI samples with the model's non-dynamic
    # delegate; after the unload, a VAE decode under a budget that a surviving delegate would not leave room for
    "001": ({"MEMBACKEND_SIM_PROFILE": "h200"}, (),
            [("prompt", "plain", txt2img_workflow(FIRST_SEED, "mb_s001_plain", checkpoint=CHECKPOINT_FP32)),
             ("prompt", "hook", txt2img_workflow(FIRST_SEED, "mb_s001_hook", hook_lora=True,
                                                 checkpoint=CHECKPOINT_FP32)),
             ("free", "free", None),
             ("headroom", "cap", lambda run: decode_cap(run)),
             ("prompt", "decode", vae_roundtrip(SD1_VAE, FIRST_SEED, "mb_s001_vae", size=512))]),
    # 003: GB10, image -> another model -> image: the second image run loads nothing
    "003": ({"MEMBACKEND_SIM_PROFILE": "gb10-128gb"}, (),
            [("prompt", "image", txt2img_workflow(FIRST_SEED, "mb_s003_a")),
             ("prompt", "other model", vae_roundtrip(SD1_VAE, FIRST_SEED, "mb_s003_vae")),
             ("prompt", "image again", txt2img_workflow(SECOND_SEED, "mb_s003_b"))]),
}
