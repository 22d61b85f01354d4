"""The real ComfyUI on a real GPU, stock beside membackend (run by ``scripts/gpu-check --comfyui TREE``).

A ComfyUI tree is served twice under the same flags and seeds: stock (comfy-aimdo's own dynamic VRAM) and
with membackend's custom node installed (``membackend comfyui install``). The models are made on the spot with
ComfyUI's own classes from seeded random weights (the real-tree suite's SD1.5-shaped checkpoint, with CLIP-L
and the SD1 VAE, in fp16, and the SD1 VAE alone); nothing is downloaded. The configurations and their phases:

* ``default`` (ComfyUI's default cache): ``cold`` (the first txt2img), ``warm`` (``--warm`` more seeds),
  ``warm, profiled`` (one more, membackend's side under ``cProfile``: the Python time spent in membackend's own
  code, from the custom node ``comfyui_profile_node.py`` installed beside membackend's), ``other model`` (an SD1
  VAE round trip: the default cache drops the checkpoint), ``first again`` (txt2img: the checkpoint loaded
  again from its file), ``after free`` (``POST /free``, then txt2img);
* ``cache`` (issue 41, item 2): membackend beside membackend with ``keep_dropped = "off"``, ``cold``, ``other
  model``, ``first again`` and ``warm``: what the cache of dropped weights saves, images compared between the
  two (under ``--standin`` with the checkpoint stored in fp32, as the CPU computes it: an fp16 checkpoint's
  weights are cast there, and a cast is never reused);
* ``lru`` (``--cache-lru 8``: ComfyUI keeps the models): ``cold``, ``other model``, ``first again``;
* ``cap`` (``--reserve-vram`` leaving ``--room`` GiB of the card): ``cold``, ``warm``, ``other model``,
  ``first again``, ``after free`` -- the two sides one after the other, since the driver's free figure is
  the whole card's;
* ``no dynamic`` (stock with ``--disable-dynamic-vram``, for reference): ``cold``, ``warm``, ``other model``,
  ``first again``.

The two sides of ``default`` and ``lru`` are served at once and their prompts alternate (never overlapping),
so drift on a shared machine falls on both. Per phase it reports ComfyUI's own prompt times ("Prompt executed
in"), the image's sha256 and, where the two sides differ, the largest and mean pixel difference, the ComfyUI
process's device memory at the phase's end and its peak during the phase (NVML, or ``nvidia-smi``), and from
membackend's status route: its loaded bytes, ComfyUI's ``vbar_fault``/``vbar_unpin`` calls and the driver's
calls, the models on ComfyUI's classic path, the weights' bytes read from their file and copied from VRAM
instead, and the bytes held as cache and by live models. Issue 41's targets (membackend's warm prompt against
stock's classic path, the first model again and cold against stock dynamic, the cap phases) close the table. Every membackend image is also compared with stock's of the
same phase of ``default`` (the cap must not change an image). It writes ``comfyui-gpu.json`` and
``comfyui-gpu.md`` into ``--out`` and prints the markdown.

What the machine lacks is brought or stood in for, and named in the output (``standins``): a package the
ComfyUI Python cannot import among ``comfy_kitchen`` and ``av`` (imported by ComfyUI at start-up, used only by
nodes this check never runs) gets a minimal stand-in module, and without ``comfyui_frontend_package`` the
server gets ``--front-end-root`` with an empty page.

``--standin`` runs the same check on a machine without a GPU, for its tests: ComfyUI under ``--cpu``, stock
on its CPU path and membackend on a simulated H200 that holds real bytes, with the real-tree suite's test
shim lifting ComfyUI's explicit CPU checks on its dynamic path; small images, few steps, no ``cap`` or ``lru``
unless asked. Times from it say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.real_comfyui import harness, weights  # noqa: E402 - the real-tree suite's models and processes

GiB, MiB = 1 << 30, 1 << 20
PROMPT_TIMEOUT = 600
STANDIN_TOTAL_GIB = 143_771 / 1024  # the simulated H200's memory (cuMemGetInfo's total)
EXECUTED = re.compile(r"Prompt executed in ([0-9.]+) seconds")

# ---------------------------------------------------------------------------------------------- stand-ins

#: what a stand-in module holds: only what ComfyUI reads when it starts (comfy/ldm/modules/attention.py,
#: comfy/text_encoders/llama.py, comfy_api/latest: attribute reads at import time); quant_ops.py and float.py
#: catch the ImportError of the names missing here, as they do without the package
STANDINS: dict[str, dict[str, str]] = {
    "comfy_kitchen": {
        "__init__.py": '"""Stand-in for comfy-kitchen (membackend\'s GPU check): no kernels, nothing available."""\n'
                       "def int8_attention_is_available(*a, **k):\n    return False\n"
                       "def flash_attention_decode_is_available(*a, **k):\n    return False\n",
    },
    "av": {
        "__init__.py": '"""Stand-in for PyAV (membackend\'s GPU check): names only, for the video nodes\' imports."""\n'
                       "def __getattr__(name):\n    return type(name, (), {})\n",
        "container.py": "def __getattr__(name):\n    return type(name, (), {})\n",
        "subtitles/__init__.py": "",
        "subtitles/stream.py": "def __getattr__(name):\n    return type(name, (), {})\n",
        "video/__init__.py": "",
        "video/reformatter.py": "class ColorRange:\n    JPEG = 2\n    MPEG = 1\n"
                                "def __getattr__(name):\n    return type(name, (), {})\n",
    },
}


def missing_modules(python: str, names: list[str]) -> list[str]:
    code = ("import importlib.util, json, sys\n"
            "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))")
    p = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else list(names)


def write_standins(folder: Path, names: list[str]) -> None:
    for name in names:
        for rel, text in STANDINS[name].items():
            path = folder / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------------------------- device memory


class ProcessMemory:
    """The device memory one process holds, from NVML (nvidia-ml-py) or ``nvidia-smi``; None without either."""

    def __init__(self) -> None:
        self.how = None
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.how = "NVML"
        except Exception:
            if shutil.which("nvidia-smi"):
                self.how = "nvidia-smi"

    def of(self, pid: int) -> int | None:
        try:
            if self._nvml is not None:
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                    if p.pid == pid:
                        return int(p.usedGpuMemory or 0)
                return 0
            if self.how == "nvidia-smi":
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                      "nounits"], capture_output=True, text=True, timeout=10).stdout
                for line in out.splitlines():
                    got = [x.strip() for x in line.split(",")]
                    if len(got) == 2 and got[0] == str(pid):
                        return int(got[1]) * MiB
                return 0
        except Exception:
            return None
        return None


class Peak:
    """Samples a process's device memory every 50 ms while a phase runs: its peak."""

    def __init__(self, memory: ProcessMemory, pid: int):
        self.memory, self.pid, self.peak = memory, pid, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            v = self.memory.of(self.pid)
            if v is not None:
                self.peak = v if self.peak is None else max(self.peak, v)
            self._stop.wait(0.05)

    def __enter__(self) -> "Peak":
        if self.memory.how is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------- servers


@dataclass
class Side:
    """One served ComfyUI: ``stock`` or ``membackend``."""

    name: str
    server: harness.Server
    seen: int = 0  # "Prompt executed in" lines read so far

    def executed(self, timeout: float = 30) -> float | None:
        """The newest "Prompt executed in" time after the last one read (waits for the line to be written)."""
        deadline = time.monotonic() + timeout
        while True:
            times = EXECUTED.findall(self.server.output())
            if len(times) > self.seen:
                self.seen = len(times)
                return float(times[-1])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def status(self) -> dict[str, Any] | None:
        if self.name == "stock":
            return None
        with contextlib.suppress(Exception):
            code, st = self.server.get("/membackend/status")
            if code == 200 and isinstance(st, dict):
                return st
        return None


@contextlib.contextmanager
def serve(tree: Path, flags: list[str], env: dict[str, str], log: Path) -> Iterator[harness.Server]:
    """``tree`` served on a free port of 127.0.0.1 with ``flags`` and this environment plus ``env``."""
    port = harness.free_port()
    cmd = [env.pop("__python__"), "main.py", *flags, "--listen", "127.0.0.1", "--port", str(port)]
    child = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    child.update(env)
    with open(log, "w", encoding="utf-8") as sink, \
            harness.spawned(cmd, cwd=tree, stdout=sink, stderr=subprocess.STDOUT, env=child) as proc:
        server = harness.Server(proc, port, tree, log)
        try:
            deadline = time.monotonic() + harness.SERVER_START_TIMEOUT
            while True:
                if proc.poll() is not None:
                    raise harness.ServerFailed(f"ComfyUI exited ({proc.returncode}) before serving:\n"
                                               f"{server.output()[-4000:]}")
                with contextlib.suppress(urllib.error.URLError, OSError):
                    if server.get("/system_stats")[0] == 200:
                        break
                if time.monotonic() > deadline:
                    raise harness.ServerFailed(f"ComfyUI did not serve in time:\n{server.output()[-4000:]}")
                time.sleep(0.25)
            yield server
        finally:
            if proc.poll() is None:
                harness._kill_group(proc, signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=harness.STOP_GRACE)


def _delta(after: dict[str, Any], before: dict[str, Any], group: str, key: str) -> int:
    return int((after.get(group) or {}).get(key) or 0) - int((before.get(group) or {}).get(key) or 0)


def _driver_calls(st: dict[str, Any]) -> int:
    """Every driver API call membackend's backend made so far, on every device (the status's ``kept``)."""
    return sum(int(n or 0) for d in (st.get("kept") or {}).values() for n in (d.get("calls") or {}).values())


PROFILE_NODE = Path(__file__).resolve().parent / "comfyui_profile_node.py"

# ---------------------------------------------------------------------------------------------- the check


@dataclass
class Step:
    """One phase on one side."""

    phase: str
    seconds: float | None = None  # ComfyUI's "Prompt executed in"; for ``warm``, the median
    all_seconds: list[float] = field(default_factory=list)
    image: str | None = None  # sha256 of the (last) image
    images: list[str] = field(default_factory=list)
    vram: int | None = None  # the process's device memory at the phase's end
    peak_vram: int | None = None
    loaded: int | None = None  # membackend's newly backed bytes in the phase
    status: dict[str, Any] = field(default_factory=dict)  # membackend's budget and models at the phase's end
    # issue 41, membackend's side, per prompt of the phase (the last one's): ComfyUI's vbar_fault and vbar_unpin
    # calls and the driver's API calls; the models on ComfyUI's classic path at the end
    faults: int | None = None
    unpins: int | None = None
    driver_calls: int | None = None
    classic: list[str] = field(default_factory=list)
    # issue 41, item 2: the weights' bytes read from their file into the device and copied from VRAM instead in
    # the phase; at its end the bytes held as cache (reclaimable) and by live models
    from_file: int | None = None
    from_vram: int | None = None
    cached: int | None = None
    held: int | None = None
    #: the profiled prompt's figures (benchmarks/comfyui_profile_node.py): Python time in membackend
    profile: dict[str, Any] | None = None


@dataclass
class Check:
    args: argparse.Namespace
    work: Path
    memory: ProcessMemory
    stock_tree: Path = field(init=False)
    node_tree: Path = field(init=False)
    results: dict[str, dict[str, list[Step]]] = field(default_factory=dict)
    paths: dict[tuple[str, str, str], Path] = field(default_factory=dict)  # (config, side, image sha) -> file
    notes: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)  # every server's flags
    env: dict[str, str] = field(default_factory=dict)
    node_env: dict[str, str] = field(default_factory=dict)

    # -- workflows

    def txt2img(self, seed: int, config: str = "default") -> dict[str, Any]:
        a = self.args
        # the cache's configuration under --standin: the checkpoint stored as the CPU computes it (fp32), so
        # that its weights are read as they are stored, as SD1.5's fp16 weights are on a GPU
        ckpt = weights.CHECKPOINT_FP32 if config == "cache" and a.standin else weights.CHECKPOINT
        wf = weights.txt2img_workflow(seed, "mb_gpu_txt2img", steps=a.steps, checkpoint=ckpt)
        wf["10"]["inputs"].update(width=a.size, height=a.size)
        return wf

    def other(self, seed: int) -> dict[str, Any]:
        return weights.vae_roundtrip(weights.SD1_VAE, seed, "mb_gpu_vae", size=self.args.size)

    # -- one prompt on one side

    def prompt(self, side: Side, wf: dict[str, Any], step: Step, config: str) -> None:
        before = side.status()
        with Peak(self.memory, side.server.proc.pid) as peak:
            images = side.server.run_prompt(wf, timeout=PROMPT_TIMEOUT)
            t = side.executed()
        sha = harness.sha256(images[0])
        self.paths[(config, side.name, sha)] = images[0]
        step.images.append(sha)
        step.image = sha
        if t is not None:
            step.all_seconds.append(t)
            step.seconds = statistics.median(step.all_seconds)
        self.finish(side, step, before, peak.peak)

    def finish(self, side: Side, step: Step, before: dict[str, Any] | None, peak: int | None) -> None:
        step.vram = self.memory.of(side.server.proc.pid)
        step.peak_vram = max(x for x in (peak, step.vram, step.peak_vram) if x is not None) \
            if any(x is not None for x in (peak, step.vram, step.peak_vram)) else None
        after = side.status()
        if after is not None:
            loaded = int(after.get("loaded_bytes") or 0) - int((before or {}).get("loaded_bytes") or 0)
            step.loaded = (step.loaded or 0) + loaded
            was = before or {}
            step.faults = _delta(after, was, "calls", "vbar_fault")
            step.unpins = _delta(after, was, "calls", "vbar_unpin")
            step.driver_calls = _driver_calls(after) - _driver_calls(was)
            step.classic = sorted(m.get("name") for m in (after.get("models") or {}).values()
                                  if m.get("path") == "classic")
            step.from_file = (step.from_file or 0) + _delta(after, was, "reads", "from_file")
            step.from_vram = (step.from_vram or 0) + _delta(after, was, "reads", "from_vram")
            step.cached = sum(int(c.get("bytes") or 0) for c in (after.get("cache") or {}).values())
            step.held = sum(int(m.get("resident") or 0) for m in (after.get("models") or {}).values()
                            if m.get("state") != "cached")
            step.status = {"budget": next(iter((after.get("budgets") or {}).values()), None),
                           "reservations": len(after.get("reservations") or []),
                           "models": {m.get("name"): {"size": m.get("size"), "resident": m.get("resident"),
                                                      "state": m.get("state")}
                                      for m in (after.get("models") or {}).values()}}

    def free(self, side: Side) -> None:
        code, answer = side.server.post("/free", {"unload_models": True, "free_memory": True})
        if code != 200:
            raise harness.HarnessError(f"POST /free answered {code}: {answer}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the prompt worker runs the free when it wakes
            st = side.status()
            if st is not None and st.get("reservations") == []:
                break
            if st is None and time.monotonic() > deadline - 13:  # stock: no route to ask; a moment is enough
                break
            time.sleep(0.1)

    # -- a configuration: its phases, on each side, alternating

    def phases(self, config: str) -> list[tuple[str, str, int]]:
        """``(phase, kind, seed)``: kind ``txt2img``, ``other`` or ``free+txt2img``."""
        warm = [("warm", "txt2img", 100 + i) for i in range(self.args.warm)]
        if config == "default":
            return [("cold", "txt2img", 1), *warm, ("warm, profiled", "profile+txt2img", 200),
                    ("other model", "other", 1), ("first again", "txt2img", 2), ("after free", "free+txt2img", 3)]
        if config == "cache":
            return [("cold", "txt2img", 1), ("other model", "other", 1), ("first again", "txt2img", 2),
                    ("warm", "txt2img", 3)]
        if config == "lru":
            return [("cold", "txt2img", 1), ("other model", "other", 1), ("first again", "txt2img", 2)]
        if config == "cap":
            return [("cold", "txt2img", 1), ("warm", "txt2img", 100), ("other model", "other", 1),
                    ("first again", "txt2img", 2), ("after free", "free+txt2img", 3)]
        if config == "no dynamic":
            return [("cold", "txt2img", 1), *warm[:3], ("other model", "other", 1), ("first again", "txt2img", 2)]
        raise ValueError(config)

    def run_config(self, config: str, sides: dict[str, tuple[Path, list[str], dict[str, str]]],
                   together: bool) -> None:
        """Serve each side (all at once when ``together``), then run the phases, alternating sides."""
        got: dict[str, list[Step]] = {name: [] for name in sides}
        self.results[config] = got
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        groups = [list(sides)] if together else [[name] for name in sides]
        for group in groups:
            with contextlib.ExitStack() as stack:
                running = {}
                for name in group:
                    tree, flags, env = sides[name]
                    log = logs / f"{harness.safe_name(config)}-{name}.log"
                    running[name] = Side(name, stack.enter_context(serve(tree, flags, dict(env), log)))
                steps: dict[str, dict[str, Step]] = {name: {} for name in group}
                for phase, kind, seed in self.phases(config):
                    for name, side in running.items():
                        step = steps[name].get(phase)
                        if step is None:
                            step = steps[name][phase] = Step(phase)
                            got[name].append(step)
                        if kind == "free+txt2img":
                            self.free(side)
                        wf = self.other(seed) if kind == "other" else self.txt2img(seed, config)
                        profiled = kind == "profile+txt2img" and side.name == "membackend"
                        if profiled:
                            side.server.post("/membackend_bench/profile", {"on": True})
                        self.prompt(side, wf, step, config)
                        if profiled:
                            side.server.post("/membackend_bench/profile", {"on": False})
                            code, profile = side.server.get("/membackend_bench/profile")
                            step.profile = profile if code == 200 else None

    # -- the whole check

    def prepare(self) -> None:
        a = self.args
        python = a.python
        missing = missing_modules(python, ["comfy_kitchen", "av", "comfyui_frontend_package"])
        standins = self.work / "standins"
        kinds = [m for m in missing if m in STANDINS]
        write_standins(standins, kinds)
        for m in kinds:
            self.notes.append(f"stand-in: {m} (not installed in {python}; a module with the names ComfyUI reads "
                              "at start-up, no kernels; the workflows here never use it)")
        if "comfyui_frontend_package" in missing:
            front = self.work / "frontend"
            front.mkdir(exist_ok=True)
            (front / "index.html").write_text("<!doctype html><title>membackend gpu check</title>\n")
            self.flags += ["--front-end-root", str(front)]
            self.notes.append("stand-in: comfyui_frontend_package (not installed): --front-end-root with an empty "
                              "page; the API is all this check uses")
        pythonpath = [str(standins), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        if a.standin:
            pythonpath.insert(0, str(harness.probe_dir()))  # its sitecustomize installs the CPU shim
            self.node_env["REAL_COMFYUI_CPU_SHIM"] = str(weights.SHIM)
            self.node_env["MEMBACKEND_SIM_PROFILE"] = a.profile
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        self.env["__python__"] = python
        self.flags += ["--use-pytorch-cross-attention"]
        # the trees: one copy with membackend's node installed, one without
        base = harness.copy_tree(a.tree, self.work / "stock")
        harness.writable(base)
        shutil.rmtree(base / "custom_nodes" / "membackend", ignore_errors=True)
        models = self.work / "models"
        # the fp32 copy (3 GB) only where the cache's configuration reads it (under --standin)
        fp32 = weights.CHECKPOINT_FP32 if a.standin and "cache" in a.configs.split(",") else ""
        builder = subprocess.Popen([python, "-c", weights.MODELS_CHILD, str(base), str(models), weights.SD1_VAE,
                                    weights.CHECKPOINT, weights.LORA, fp32], cwd=base,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": self.env["PYTHONPATH"],
                                        **({"CUDA_VISIBLE_DEVICES": ""} if a.standin else {})})
        self.node_tree = harness.copy_tree(base, self.work / "node")
        self.stock_tree = base
        subprocess.run([python, "-m", "membackend", "comfyui", "install", str(self.node_tree)], check=True,
                       env={**os.environ, "PYTHONPATH": self.env["PYTHONPATH"]}, capture_output=True, timeout=120)
        profiler = self.node_tree / "custom_nodes" / "membackend_bench_profile"
        profiler.mkdir()
        shutil.copy(PROFILE_NODE, profiler / "__init__.py")
        out, err = builder.communicate(timeout=900)
        if builder.returncode != 0:
            raise harness.HarnessError(f"building the models failed:\n{err[-3000:]}")
        self.models = json.loads(out.strip().splitlines()[-1])
        for tree in (self.stock_tree, self.node_tree):
            weights.model_paths(tree, models)

    def sides(self, extra: list[str]) -> dict[str, tuple[Path, list[str], dict[str, str]]]:
        if self.args.standin:
            stock_flags = ["--cpu", *self.flags, *extra]
            node_flags = ["--cpu", "--enable-dynamic-vram", *self.flags, *extra]
        else:
            stock_flags = node_flags = [*self.flags, *extra]
        return {"stock": (self.stock_tree, stock_flags, dict(self.env)),
                "membackend": (self.node_tree, node_flags, {**self.env, **self.node_env})}

    def run(self) -> dict[str, Any]:
        a = self.args
        t0 = time.monotonic()
        self.prepare()
        configs = a.configs.split(",")
        if "default" in configs:
            self.run_config("default", self.sides([]), together=True)
            self.save(round(time.monotonic() - t0, 1))
        if "cache" in configs:  # issue 41, item 2: membackend with its cache beside membackend without
            node = self.sides([])["membackend"]
            off = (node[0], node[1], {**node[2], "MEMBACKEND_KEEP_DROPPED": "off"})
            self.run_config("cache", {"keep_dropped off": off, "membackend": node}, together=True)
            self.save(round(time.monotonic() - t0, 1))
        if "cap" in configs:  # before lru: the figures a timeout would cut last matter least
            reserve = max(0.0, a.total_gib - a.room)
            self.notes.append(f"cap: --reserve-vram {reserve:.2f} of {a.total_gib:.2f} GiB (room {a.room} GiB)")
            self.run_config("cap", self.sides(["--reserve-vram", f"{reserve:.2f}"]), together=False)
            self.save(round(time.monotonic() - t0, 1))
        if "lru" in configs or "no dynamic" in configs:  # served together: stock's no-dynamic run beside lru's
            sides = self.sides(["--cache-lru", "8"]) if "lru" in configs else {}
            if "no dynamic" in configs and not a.standin:
                sides["no dynamic"] = (self.stock_tree, [*self.flags, "--disable-dynamic-vram"], dict(self.env))
            self.run_config("lru", sides, together=True)
            if "no dynamic" in sides:
                self.results["no dynamic"] = {"stock": self.results["lru"].pop("no dynamic")}
        return self.report(round(time.monotonic() - t0, 1))

    def save(self, seconds: float) -> None:
        """The figures so far, written as the finished check writes them (a run stopped later keeps them)."""
        write(self.args.out_dir, {**self.report(seconds), "partial": True})

    # -- judging

    def diff(self, a: Path, b: Path) -> dict[str, float] | None:
        code = ("import sys, json, numpy as np\nfrom PIL import Image\n"
                "x, y = (np.asarray(Image.open(p).convert('RGB'), dtype=np.int16) for p in sys.argv[1:3])\n"
                "d = np.abs(x - y) if x.shape == y.shape else None\n"
                "print(json.dumps(None if d is None else {'max': int(d.max()), 'mean': round(float(d.mean()), 3)}))")
        p = subprocess.run([self.args.python, "-c", code, str(a), str(b)], capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None

    def report(self, seconds: float) -> dict[str, Any]:
        rows = []
        reference = {s.phase: s for s in self.results.get("default", {}).get("stock", [])}
        for config, sides in self.results.items():
            # each membackend side is compared with the configuration's first side (stock's; the cache's own
            # configuration: membackend with keep_dropped off)
            first = next(iter(sides), "stock")
            stock = {s.phase: s for s in sides.get(first, [])}
            for name, steps in sides.items():
                for s in steps:
                    row: dict[str, Any] = {"config": config, "side": name, **asdict(s)}
                    ref = stock.get(s.phase) if name != first else None
                    if ref is not None and s.seconds and ref.seconds:
                        row["ratio"] = round(s.seconds / ref.seconds, 3)
                    if ref is not None:
                        row["equal"] = s.images == ref.images
                        if not row["equal"] and s.image and ref.image:
                            row["difference"] = self.diff(self.paths[(config, first, ref.image)],
                                                          self.paths[(config, name, s.image)])
                    base = reference.get(s.phase)
                    if config not in ("default", "cache") and base is not None and s.image and s.phase != "warm":
                        row["equal_to_default_stock"] = s.image == base.image
                    rows.append(row)
        out = {"seconds": seconds, "python": self.args.python, "size": self.args.size, "steps": self.args.steps,
               "standin": bool(self.args.standin), "vram_from": self.memory.how, "notes": self.notes,
               "models": getattr(self, "models", None), "rows": rows}
        out["targets"] = targets(rows, bool(self.args.standin))
        return out


def targets(rows: list[dict[str, Any]], standin: bool) -> list[dict[str, Any]]:
    """Issue 41's targets from the rows that are there: each a ``what``, the measured ``ratio`` (membackend's
    over the reference's prompt time), the ``target`` and the two times."""
    def find(config: str, side: str, phase: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["config"] == config and r["side"] == side and r["phase"] == phase), None)

    out = []

    def add(what: str, mine: dict[str, Any] | None, ref: dict[str, Any] | None, target: float) -> None:
        if mine and ref and mine.get("seconds") and ref.get("seconds"):
            out.append({"what": what, "membackend_s": mine["seconds"], "reference_s": ref["seconds"],
                         "ratio": round(mine["seconds"] / ref["seconds"], 3), "target": target})

    classic = "stock --cpu (ComfyUI's classic path)" if standin else "stock --disable-dynamic-vram"
    add(f"warm prompt (median) vs {classic}", find("default", "membackend", "warm"),
        find("default", "stock", "warm") if standin else find("no dynamic", "stock", "warm"), 1.05)
    if not standin:
        add("warm prompt (median) vs stock dynamic", find("default", "membackend", "warm"),
            find("default", "stock", "warm"), 0.75)
        add("first model again vs stock dynamic", find("default", "membackend", "first again"),
            find("default", "stock", "first again"), 0.8)
        for phase in ("cold", "after free"):
            add(f"{phase} vs stock dynamic", find("default", "membackend", phase), find("default", "stock", phase), 1.0)
        for phase in ("cold", "warm", "other model", "first again", "after free"):
            add(f"cap, {phase} vs stock", find("cap", "membackend", phase), find("cap", "stock", phase), 1.25)
    return out


def markdown(out: dict[str, Any]) -> str:
    def mib(v: Any) -> str:
        return "—" if v is None else f"{v / MiB:,.0f}"

    def sec(v: Any) -> str:
        return "—" if v is None else f"{v:.2f}"

    lines = [f"ComfyUI on {'a simulated H200 (stand-in, --cpu)' if out['standin'] else 'the GPU'}: "
             f"{out['size']}x{out['size']}, {out['steps']} steps; device memory from {out['vram_from'] or 'nothing'}; "
             f"{out['seconds']} s in all", ""]
    lines += [f"- {n}" for n in out["notes"]] + [""]
    def mb(v: Any) -> str:
        return "—" if v is None else f"{v / 1e6:,.0f}"

    def n(v: Any) -> str:
        return "—" if v is None else f"{v:,}"

    lines += ["| config | phase | side | prompt s | ratio | image equal to the first side | VRAM end / peak MiB | "
              "loaded MB | faults / unpins / driver calls | classic path | read from file / from VRAM MB | "
              "cached / held MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        eq = "" if "equal" not in r else ("yes" if r.get("equal") else f"no {r.get('difference')}")
        if "equal_to_default_stock" in r:
            eq += f"{'; ' if eq else ''}= default stock: {'yes' if r['equal_to_default_stock'] else 'no'}"
        calls = "" if r.get("faults") is None else f"{n(r['faults'])} / {n(r['unpins'])} / {n(r['driver_calls'])}"
        reads = "" if r.get("from_file") is None else f"{mb(r['from_file'])} / {mb(r['from_vram'])}"
        kept = "" if r.get("cached") is None else f"{mb(r['cached'])} / {mb(r['held'])}"
        lines.append(f"| {r['config']} | {r['phase']} | {r['side']} | {sec(r['seconds'])} | "
                     f"{r.get('ratio', '')} | {eq} | {mib(r['vram'])} / {mib(r['peak_vram'])} | {mb(r['loaded'])} | "
                     f"{calls} | {', '.join(r.get('classic') or []) if r.get('faults') is not None else ''} | "
                     f"{reads} | {kept} |")
    profiled = [r for r in out["rows"] if r.get("profile")]
    for r in profiled:
        p = r["profile"]
        lines += ["", f"Python time in membackend on a profiled warm prompt (cProfile, {r['config']}): "
                      f"{p.get('membackend_s', 0) * 1000:,.1f} ms of {p.get('total_s', 0) * 1000:,.0f} ms profiled, "
                      f"in {p.get('calls', 0):,} calls"]
    if out.get("targets"):
        lines += ["", "| issue 41 target | membackend s | reference s | ratio | target |", "|---|---|---|---|---|"]
        lines += [f"| {t['what']} | {t['membackend_s']:.2f} | {t['reference_s']:.2f} | {t['ratio']} | "
                  f"<= {t['target']} |" for t in out["targets"]]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, out: dict[str, Any]) -> str:
    """``comfyui-gpu.json`` and ``comfyui-gpu.md`` in ``out_dir``; returns the markdown."""
    (out_dir / "comfyui-gpu.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
    md = markdown(out)
    (out_dir / "comfyui-gpu.md").write_text(md, encoding="utf-8")
    return md


def device_total_gib() -> float:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / GiB
    except Exception:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="a ComfyUI tree (copied, never written)")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs ComfyUI (default: this one)")
    ap.add_argument("--out", type=Path, default=None, help="where the JSON, markdown and logs go")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=6, help="warm prompts (another seed each)")
    ap.add_argument("--room", type=float, default=0.9, help="GiB the cap leaves of the card")
    ap.add_argument("--total-gib", type=float, default=0.0,
                    help="the card's size for the cap (default: NVML's total; under --standin the H200's)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated: default, cache, lru, cap, no dynamic (default: default,lru,cap,no dynamic; "
                         "under --standin: default,cache)")
    ap.add_argument("--standin", action="store_true", help="no GPU: --cpu, a simulated H200 (for the tests)")
    ap.add_argument("--profile", default="h200", help="the simulated machine under --standin")
    a = ap.parse_args(argv)
    a.configs = a.configs or ("default,cache" if a.standin else "default,lru,cap,no dynamic")
    a.tree = a.tree.resolve()
    a.python = os.path.abspath(a.python) if os.sep in a.python else shutil.which(a.python) or a.python
    if not a.standin:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from bench_gpu import detect

        n, why = detect()
        if not n:
            print(json.dumps({"skipped": f"no CUDA device ({why})"}))
            return 0
    a.total_gib = a.total_gib or (STANDIN_TOTAL_GIB if a.standin else device_total_gib())
    out_dir = a.out or Path(tempfile.mkdtemp(prefix="membackend-comfyui-gpu-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    a.out_dir = out_dir
    work = Path(tempfile.mkdtemp(prefix="work-", dir=out_dir))
    check = Check(a, work, ProcessMemory())
    try:
        out = check.run()
    except Exception as exc:
        import traceback

        out = check.report(0.0)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=-6)
    finally:
        harness.kill_all(stop=False)
    print(write(out_dir, out))
    if "error" in out:
        print(f"error: {out['error']}\n{out.get('traceback', '')}", file=sys.stderr)
    shutil.rmtree(work / "stock", ignore_errors=True)
    shutil.rmtree(work / "node", ignore_errors=True)
    shutil.rmtree(work / "models", ignore_errors=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
