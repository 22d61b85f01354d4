"""Run ComfyUI from a real tree, with and without membackend's custom node, and judge the runs.

Everything here runs ComfyUI in child processes of the Python that runs it (``ComfyPython``),
each bounded by a timeout and started in its own process group, which is killed afterwards.

* :func:`run_comfyui` — ``main.py FLAGS --quick-test-for-ci`` once: ``Run(rc, output, seconds, probe)``.
* :func:`serve` — ``main.py FLAGS --listen 127.0.0.1 --port N`` as a context manager; the
  :class:`Server` it yields posts prompts and reads JSON routes.
* :func:`build_vae` — a TAESD with seeded random weights, saved in ``models/vae/``.

The matrix (flags x membackend selection x comfy-aimdo version) is described by :data:`FLAGS`,
:data:`SELECTIONS`, :data:`AIMDO_VERSIONS`, :data:`CI_CASES` and judged by :func:`judge`
against the documented start-up contract (:func:`expected`). :class:`Report` writes what was
found as JSON and markdown.

comfy-aimdo versions other than the one installed in the Python's site-packages live in
``<venv>/aimdo/<version>/`` (``pip install --no-deps --target``; ``scripts/comfyui-python``
makes them) and are put first on ``PYTHONPATH`` for a run. ``comfy_aimdo`` is a namespace
package, so the child itself reports, at exit, which version and which files it imported
(a ``sitecustomize`` the harness writes, see :data:`PROBE`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

REPO = Path(__file__).resolve().parents[2]

QUICK_TEST_TIMEOUT = 240  # seconds for one `--quick-test-for-ci` run
SERVER_START_TIMEOUT = 180  # seconds until /system_stats answers
WORKFLOW_TIMEOUT = 120  # seconds for one prompt to finish
FREE_TIMEOUT = 10  # seconds for reservations to go after POST /free
CHILD_TIMEOUT = 240  # any other child (VAE, probes, measurements)
STOP_GRACE = 15  # seconds between SIGINT and SIGKILL when stopping a server
LINE_LIMIT = 200  # the start-up line's documented maximum length

# ---------------------------------------------------------------------------------------------- the matrix

FLAGS: dict[str, tuple[str, ...]] = {
    "cpu": ("--cpu",),
    "cpu+enable-dynamic-vram": ("--cpu", "--enable-dynamic-vram"),
    "cpu+disable-dynamic-vram": ("--cpu", "--disable-dynamic-vram"),
    "cpu+disable-smart-memory": ("--cpu", "--disable-smart-memory"),
    "cpu+reserve-vram-1": ("--cpu", "--reserve-vram", "1"),
    "cpu+vram-headroom-1": ("--cpu", "--vram-headroom", "1"),
}

# the simulated GPU machine each profile describes, and the backend membackend selects there
PROFILE_BACKENDS = {"h200": "vmm", "wddm-6gb": "cuda_wddm", "gb10-128gb": "unified_gb10",
                    "rocm-win-2gpu": "rocm_windows"}

# membackend's selection, as environment variables (never set to an empty string: that is a setting)
SELECTIONS: dict[str, dict[str, str]] = {
    "disabled": {"MEMBACKEND_DISABLE": "1"},
    "host-fallback": {},
    "aimdo-forced": {"MEMBACKEND_BACKEND": "aimdo"},
    **{profile: {"MEMBACKEND_SIM_PROFILE": profile} for profile in PROFILE_BACKENDS},
    "host-forced": {"MEMBACKEND_BACKEND": "host"},
}

AIMDO_VERSIONS = ("0.4.13", "0.5.5", "0.6.0")

# ComfyUI's own switches that turn its dynamic path off (comfy.cli_args.enables_dynamic_vram)
DYNAMIC_OFF = ("--disable-dynamic-vram", "--highvram", "--gpu-only", "--novram", "--cpu")


@dataclass(frozen=True, order=True)
class Case:
    flags: str  # a key of FLAGS
    selection: str  # a key of SELECTIONS
    aimdo: str  # one of AIMDO_VERSIONS

    @property
    def id(self) -> str:
        return f"{self.flags}/{self.selection}/aimdo-{self.aimdo}"  # characters pytest's -k accepts


# The covering CI subset: every flag set at least once with an accelerator backend selected (a simulated
# profile), every selection at least once, every comfy-aimdo version at least once.
CI_CASES: tuple[Case, ...] = (
    Case("cpu", "disabled", "0.4.13"),
    Case("cpu", "h200", "0.6.0"),
    Case("cpu+enable-dynamic-vram", "h200", "0.4.13"),
    Case("cpu+enable-dynamic-vram", "wddm-6gb", "0.5.5"),
    Case("cpu+enable-dynamic-vram", "gb10-128gb", "0.6.0"),
    Case("cpu+enable-dynamic-vram", "rocm-win-2gpu", "0.4.13"),
    Case("cpu+enable-dynamic-vram", "host-fallback", "0.5.5"),
    Case("cpu+enable-dynamic-vram", "host-forced", "0.6.0"),
    Case("cpu+enable-dynamic-vram", "aimdo-forced", "0.4.13"),
    Case("cpu+enable-dynamic-vram", "disabled", "0.6.0"),
    Case("cpu+disable-dynamic-vram", "h200", "0.5.5"),
    Case("cpu+disable-smart-memory", "wddm-6gb", "0.4.13"),
    Case("cpu+reserve-vram-1", "gb10-128gb", "0.6.0"),
    Case("cpu+vram-headroom-1", "rocm-win-2gpu", "0.5.5"),
)


def full_cases() -> tuple[Case, ...]:
    return tuple(Case(f, s, a) for f in FLAGS for s in SELECTIONS for a in AIMDO_VERSIONS)


def matrix_cases(mode: str | None) -> tuple[Case, ...]:
    """``full`` (``MEMBACKEND_COMFYUI_MATRIX=full``): every combination; anything else: the CI subset."""
    return full_cases() if (mode or "").strip().lower() == "full" else CI_CASES


def comfy_dynamic(flags: tuple[str, ...]) -> bool:
    """ComfyUI's own rule (``enables_dynamic_vram``) for the flag sets of :data:`FLAGS`."""
    return "--enable-dynamic-vram" in flags or not any(f in flags for f in DYNAMIC_OFF)


def expected(case: Case) -> str:
    """The documented decision: ``off``, ``stock`` or ``using <backend>``.

    membackend takes over only when ComfyUI runs its dynamic path on devices the backend serves
    (a simulated profile counts); otherwise ComfyUI runs stock."""
    if case.selection == "disabled":
        return "off"
    if comfy_dynamic(FLAGS[case.flags]) and case.selection in PROFILE_BACKENDS:
        return f"using {PROFILE_BACKENDS[case.selection]}"
    return "stock"


# ---------------------------------------------------------------------------------------------- output

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LEVEL = re.compile(r"^\[(?:DEBUG|DETAIL|INFO|WARNING|ERROR|CRITICAL)\] ")
MEMBACKEND_LINE = re.compile(r"^membackend \S+: ")
PRESTARTUP_DONE = "Prestartup times for custom nodes"
NODES_DONE = "Import times for custom nodes"


def log_lines(output: str) -> list[str]:
    """ComfyUI's output without its colours and ``[LEVEL]`` tags."""
    return [LEVEL.sub("", ANSI.sub("", line)) for line in output.splitlines()]


def membackend_lines(output: str) -> list[str]:
    return [line for line in log_lines(output) if MEMBACKEND_LINE.match(line)]


def prestartup_lines(output: str) -> list[str]:
    """The membackend lines printed before ComfyUI reports its prestartup scripts' times (before its
    custom nodes' import times when that report is missing)."""
    lines = log_lines(output)
    for marker in (PRESTARTUP_DONE, NODES_DONE):
        end = next((i for i, line in enumerate(lines) if marker in line), None)
        if end is not None:
            lines = lines[:end]
            break
    return [line for line in lines if MEMBACKEND_LINE.match(line)]


#: what ComfyUI prints when the harness's SIGINT stops its server
SERVER_STOPPED = "Stopped server"


def exceptions(output: str, *trees: Path, stopped_by_us: bool = False) -> Counter[str]:
    """The exception line that ends each traceback in ``output``, tree paths replaced by ``<tree>``.

    ``stopped_by_us``: the harness stopped the server with SIGINT, so a ``KeyboardInterrupt`` traceback after
    ComfyUI's "Stopped server" line is that interrupt landing wherever the event loop was (aiohttp closing a
    connection, on any configuration, stock's too, depending on timing), not the configuration's: left out."""
    lines = log_lines(output)
    stopped = next((i for i, line in enumerate(lines) if SERVER_STOPPED in line), len(lines)) if stopped_by_us \
        else len(lines)
    found: Counter[str] = Counter()
    for i, line in enumerate(lines):
        if line.strip() != "Traceback (most recent call last):":
            continue
        end = next((x for x in lines[i + 1:] if x and not x[0].isspace()), "<traceback without an exception line>")
        if i > stopped and end.strip() == "KeyboardInterrupt":
            continue
        for tree in trees:
            end = end.replace(str(tree), "<tree>")
        found[end] += 1
    return found


# ---------------------------------------------------------------------------------------------- processes

class HarnessError(RuntimeError):
    """The harness could not do what it was asked; the message says why."""


# Written as ``sitecustomize.py`` into a folder put first on the child's PYTHONPATH: at exit the child
# writes, as JSON to $REAL_COMFYUI_PROBE, which comfy_aimdo it imported and whether membackend runs.
PROBE = r'''# written by tests/real_comfyui/harness.py (membackend's real-ComfyUI tests)
import atexit as _atexit
import os as _os
import sys as _sys


def _real_comfyui_probe():
    path = _os.environ.get("REAL_COMFYUI_PROBE")
    if not path:
        return
    import json
    info = {}
    try:
        from comfy_aimdo import _version
        info["aimdo_version"] = _version.__version__
    except Exception as exc:
        info["aimdo_version"] = None
        info["aimdo_error"] = "%s: %s" % (type(exc).__name__, exc)
    info["aimdo_files"] = sorted(str(getattr(m, "__file__", None)) for n, m in list(_sys.modules.items())
                                 if m is not None and (n == "comfy_aimdo" or n.startswith("comfy_aimdo.")))
    st = _sys.modules.get("membackend._comfyui.startup")
    mb = {"imported": st is not None}
    try:
        rt = st.current() if st is not None else None
        mb.update(armed=rt is not None, started=getattr(rt, "started", None), aborted=getattr(rt, "aborted", None),
                  backend=getattr(rt, "name", None))
    except Exception as exc:
        mb["error"] = "%s: %s" % (type(exc).__name__, exc)
    info["membackend"] = mb
    mp = _sys.modules.get("comfy.model_patcher")
    info["core_patcher"] = getattr(getattr(mp, "CoreModelPatcher", None), "__name__", None)
    info["aimdo_enabled"] = getattr(_sys.modules.get("comfy.memory_management"), "aimdo_enabled", None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(info, f)


_atexit.register(_real_comfyui_probe)

# the test-only CPU shim (tests/real_comfyui/cpu_shim.py), when the harness asks for it: ComfyUI's explicit
# CPU checks on its dynamic path are lifted before ComfyUI imports comfy
if _os.environ.get("REAL_COMFYUI_CPU_SHIM"):
    import importlib.util as _shim_util

    _shim_spec = _shim_util.spec_from_file_location("membackend_cpu_shim", _os.environ["REAL_COMFYUI_CPU_SHIM"])
    _shim = _shim_util.module_from_spec(_shim_spec)
    _sys.modules["membackend_cpu_shim"] = _shim
    _shim_spec.loader.exec_module(_shim)
    _shim.install()

# another sitecustomize further along the path (the interpreter's own) still runs
try:
    import importlib.machinery as _machinery
    import importlib.util as _util

    _here = _os.path.dirname(_os.path.abspath(__file__))
    _spec = _machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here])
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _spec.loader.exec_module(_module)
except Exception:
    pass
'''

_probe_dir: Path | None = None
_probe_lock = threading.Lock()


def probe_dir() -> Path:
    """The folder holding the probe's ``sitecustomize.py`` (written once per process)."""
    global _probe_dir
    with _probe_lock:
        if _probe_dir is None:
            folder = Path(tempfile.mkdtemp(prefix="membackend-rc-probe-"))
            (folder / "sitecustomize.py").write_text(PROBE, encoding="utf-8")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            _probe_dir = folder
        return _probe_dir


@dataclass
class ComfyPython:
    """The Python that runs ComfyUI, and which comfy-aimdo versions it can run."""

    path: str
    aimdo_installed: str  # the version in its site-packages
    membackend_file: str
    torch: str

    @property
    def venv(self) -> Path:
        return Path(self.path).absolute().parent.parent  # <venv>/bin/python; symlinks are not followed

    def aimdo_dir(self, version: str | None) -> Path | None:
        """The folder to put first on PYTHONPATH for ``version`` (None: the installed one)."""
        if version is None or version == self.aimdo_installed:
            return None
        folder = self.venv / "aimdo" / version
        if not (folder / "comfy_aimdo" / "_version.py").is_file():
            raise AimdoMissing(f"comfy-aimdo {version} is not installed in {folder} (the Python's own is "
                               f"{self.aimdo_installed}); scripts/comfyui-python installs it there")
        return folder

    def aimdo_root(self, version: str | None) -> Path | None:
        """Where ``version``'s comfy_aimdo modules must come from (None: anywhere but the extra folders)."""
        folder = self.aimdo_dir(version)
        return None if folder is None else folder / "comfy_aimdo"


class AimdoMissing(HarnessError):
    pass


INSPECT = """if True:
    import json, sys
    out = {}
    try:
        from comfy_aimdo import _version
        out["aimdo"] = _version.__version__
    except Exception as exc:
        out["aimdo_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import membackend
        out["membackend"] = membackend.__file__
    except Exception as exc:
        out["membackend_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import importlib.metadata as md
        out["torch"] = md.version("torch")
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
"""


def inspect_python(path: str) -> ComfyPython:
    """What ``path`` runs; :class:`HarnessError` when it cannot run membackend's adapter inside ComfyUI."""
    got = json.loads(run_child([path, "-c", INSPECT]).stdout.strip().splitlines()[-1])
    problems = [got[k] for k in ("aimdo_error", "membackend_error", "torch_error") if k in got]
    if problems:
        raise HarnessError(f"{path} cannot run ComfyUI with membackend: {'; '.join(problems)}; "
                           "build it with scripts/comfyui-python")
    here = REPO / "membackend"
    if Path(got["membackend"]).resolve().parent != here.resolve():
        raise HarnessError(f"{path} imports membackend from {got['membackend']}, not from {here}: install this "
                           "checkout into it (scripts/comfyui-python does: pip install --no-deps -e <repo>)")
    return ComfyPython(path, got["aimdo"], got["membackend"], got["torch"])


def child_env(extra: dict[str, str] | None = None, pythonpath: tuple[Path, ...] | list[Path] = (),
              probe: Path | None = None) -> dict[str, str]:
    """This environment without any MEMBACKEND_* variable or Python path of its own, for a machine without
    a GPU (the matrix's expectations assume one), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("MEMBACKEND_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HIP_VISIBLE_DEVICES"] = ""
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    if probe is not None:
        env["REAL_COMFYUI_PROBE"] = str(probe)
    env.update(extra or {})
    return env


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


_live: set[subprocess.Popen] = set()  # every child started here whose group is not killed yet
_live_lock = threading.Lock()
_stopping = False


@contextlib.contextmanager
def spawned(cmd: list[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``Popen(cmd)`` in its own process group, killed (SIGKILL to the group) on the way out, whatever
    happens; :func:`kill_all` reaches it meanwhile."""
    with _live_lock:
        if _stopping:
            raise HarnessError("the harness is stopping: no new ComfyUI process")
        proc = subprocess.Popen(cmd, start_new_session=True, **popen)
        _live.add(proc)
    try:
        yield proc
    finally:
        _kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE)
        with _live_lock:
            _live.discard(proc)


def kill_all(stop: bool = True) -> None:
    """Kill every child's process group still running; ``stop``: and refuse new ones (an interrupted
    session, or this process exiting)."""
    global _stopping
    with _live_lock:
        _stopping = _stopping or stop
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)


atexit.register(kill_all)


def run_child(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
              timeout: float = CHILD_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    """A bounded child in its own process group (killed on timeout); ``check``: raise on a non-zero exit."""
    with spawned(cmd, cwd=cwd, env=env if env is not None else child_env(), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise HarnessError(f"{' '.join(cmd[:3])} ... ran past {timeout} s and was killed; stderr: "
                               f"{err[-2000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {(err or out)[-3000:]}")
    return done


class Run(NamedTuple):
    rc: int | None  # None: it ran past its timeout and was killed
    output: str  # stdout and stderr together
    seconds: float
    probe: dict[str, Any] | None  # what the child reported at exit (None: it did not get there)


def run_comfyui(tree: Path, flags: tuple[str, ...], env: dict[str, str] | None = None, aimdo: str | None = None,
                *, python: ComfyPython, timeout: float = QUICK_TEST_TIMEOUT) -> Run:
    """``main.py FLAGS --quick-test-for-ci`` in ``tree``: start everything, custom nodes included, and exit."""
    extra = python.aimdo_dir(aimdo)
    with tempfile.TemporaryDirectory(prefix="membackend-rc-run-") as tmp:
        probe = Path(tmp) / "probe.json"
        cmd = [python.path, "main.py", *flags, "--quick-test-for-ci"]
        t0 = time.monotonic()
        with spawned(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                     env=child_env(env, [probe_dir(), *([extra] if extra else [])], probe)) as proc:
            try:
                output, _ = proc.communicate(timeout=timeout)
                rc: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                output, _ = proc.communicate()
                output += f"\n[harness] killed after {timeout} s\n"
                rc = None
        seconds = time.monotonic() - t0
        try:
            got = json.loads(probe.read_text(encoding="utf-8")) if probe.is_file() else None
        except ValueError:
            got = None
    return Run(rc, output, seconds, got)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(HarnessError):
    pass


class Server:
    """A running ComfyUI server on 127.0.0.1 (see :func:`serve`)."""

    def __init__(self, proc: subprocess.Popen, port: int, tree: Path, log: Path):
        self.proc, self.port, self.tree, self.log = proc, port, tree, log
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10) -> tuple[int, Any]:
        """``(status, JSON or text)``; a refused connection raises ``URLError``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        text = raw.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def run_prompt(self, prompt: dict[str, Any], timeout: float = WORKFLOW_TIMEOUT) -> list[Path]:
        """Queue ``prompt`` (API format), wait for it, return the images it saved (in ``output/``)."""
        status, answer = self.post("/prompt", {"prompt": prompt, "client_id": "membackend-real-comfyui"})
        if status != 200 or not isinstance(answer, dict) or "prompt_id" not in answer:
            raise HarnessError(f"POST /prompt answered {status}: {answer}")
        pid = answer["prompt_id"]
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server exited ({self.proc.returncode}) while running the prompt:\n"
                                   f"{self.output()[-4000:]}")
            _, history = self.get(f"/history/{pid}")
            entry = history.get(pid) if isinstance(history, dict) else None
            state = (entry or {}).get("status") or {}
            if state.get("completed") or state.get("status_str") == "error":
                break
            if time.monotonic() > deadline:
                raise HarnessError(f"prompt {pid} did not finish in {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(0.25)
        if state.get("status_str") != "success":
            raise HarnessError(f"prompt {pid} failed: {json.dumps(state.get('messages'))[-3000:]}\n"
                               f"{self.output()[-3000:]}")
        images = [self.tree / "output" / img.get("subfolder", "") / img["filename"]
                  for out in entry.get("outputs", {}).values() for img in out.get("images", [])]
        if not images:
            raise HarnessError(f"prompt {pid} saved no image: {json.dumps(entry.get('outputs'))}")
        return images


@contextlib.contextmanager
def serve(tree: Path, flags: tuple[str, ...], env: dict[str, str] | None = None, aimdo: str | None = None, *,
          python: ComfyPython, log: Path, start_timeout: float = SERVER_START_TIMEOUT) -> Iterator[Server]:
    """ComfyUI's server from ``tree`` on a free port of 127.0.0.1, up once ``/system_stats`` answers; its
    output goes to ``log``. Stopped on exit (SIGINT, then SIGKILL to its process group)."""
    extra = python.aimdo_dir(aimdo)
    port = free_port()
    cmd = [python.path, "main.py", *flags, "--listen", "127.0.0.1", "--port", str(port)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as sink, \
            spawned(cmd, cwd=tree, stdout=sink, stderr=subprocess.STDOUT,
                    env=child_env(env, [probe_dir(), *([extra] if extra else [])])) as proc:
        server = Server(proc, port, tree, log)
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if proc.poll() is not None:
                    out = server.output()
                    last = list(exceptions(out, tree))[-1:] or ["no traceback"]
                    raise ServerFailed(f"ComfyUI exited ({proc.returncode}) before serving ({' '.join(flags)}): "
                                       f"{last[0]}\n{out[-4000:]}")
                try:
                    if server.get("/system_stats")[0] == 200:
                        break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise ServerFailed(f"ComfyUI did not serve within {start_timeout} s:\n{server.output()[-4000:]}")
                time.sleep(0.5)
            yield server
        finally:
            if proc.poll() is None:  # Ctrl-C first, so that ComfyUI stops as it does for a user
                _kill_group(proc, signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_GRACE)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- trees, VAE

VAE_NAME = "membackend_test_taesd.safetensors"

VAE_CHILD = """if True:
    import sys
    tree, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, tree)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    import comfy.taesd.taesd
    from safetensors.torch import save_file

    # the class comfy.sd.VAE builds for a state dict with "taesd_decoder.1.weight"; ComfyUI's layers skip
    # weight initialisation, so every tensor is filled here, from one seeded generator
    model = comfy.taesd.taesd.TAESD(latent_channels=4)
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for name, t in sorted(model.state_dict().items()):
        if name in ("vae_scale", "vae_shift"):
            v = torch.tensor(1.0 if name == "vae_scale" else 0.0)
        elif t.dim() > 1:
            v = torch.randn(tuple(t.shape), generator=gen) * (2.0 / t[0].numel()) ** 0.5
        else:
            v = torch.randn(tuple(t.shape), generator=gen) * 0.01
        sd[name] = v.to(torch.float32).contiguous()
    save_file(sd, out)
    print(len(sd))
"""


def build_vae(tree: Path, *, python: ComfyPython, name: str = VAE_NAME) -> Path:
    """A TAESD (ComfyUI's own class) with seeded random weights, in ``tree/models/vae/name``; the same bytes
    on every call."""
    out = tree / "models" / "vae" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    run_child([python.path, "-c", VAE_CHILD, str(tree), str(out)], cwd=tree)
    return out


def safe_name(label: str) -> str:
    """``label`` as a file name: ``/`` between a case's parts becomes ``__``, anything odd ``_``."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", label.replace("/", "__"))


def writable(tree: Path) -> None:
    """Add the owner's write bit to everything in ``tree`` (copies keep the source's modes)."""
    for root, dirs, files in os.walk(tree):
        for name in (".", *dirs, *files):
            p = os.path.join(root, name)
            if not os.path.islink(p):
                mode = os.stat(p).st_mode
                if not mode & stat.S_IWUSR:
                    os.chmod(p, mode | stat.S_IWUSR)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@dataclass
class Trees:
    """Copies of the tree under test: ``stock`` (no membackend node) and ``node`` (node installed), both with
    the test VAE and compiled bytecode; runs get scratch copies of them (ComfyUI writes into its tree)."""

    stock: Path
    node: Path
    scratch: Path
    vae: str = VAE_NAME
    _n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def prepare(cls, source: Path, work: Path, python: ComfyPython) -> "Trees":
        base = copy_tree(source, work / "base")
        writable(base)  # a shared tree may have no write bits; ComfyUI writes into its own
        shutil.rmtree(base / "custom_nodes" / "membackend", ignore_errors=True)
        build_vae(base, python=python)
        # bytecode once, here, so that every scratch copy starts from compiled modules
        run_child([python.path, "-m", "compileall", "-q", "-j", "0", "-x", r"[/\\]tests", str(base)], check=False)
        stock = copy_tree(base, work / "stock")
        node = copy_tree(base, work / "node")
        run_child([python.path, "-m", "membackend._cli", "comfyui", "install", str(node)])
        if not (node / "custom_nodes" / "membackend" / "prestartup_script.py").is_file():
            raise HarnessError(f"`membackend comfyui install {node}` wrote no prestartup_script.py")
        shutil.rmtree(base)
        scratch = work / "scratch"
        scratch.mkdir()
        return cls(stock, node, scratch)

    @contextlib.contextmanager
    def scratch_copy(self, template: Path, label: str) -> Iterator[Path]:
        with self._lock:
            self._n += 1
            dst = self.scratch / f"{self._n:04d}-{safe_name(label)}"
        copy_tree(template, dst)
        try:
            yield dst
        finally:
            shutil.rmtree(dst, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the judge

@dataclass
class CaseResult:
    case: Case
    expected: str
    stock_rc: int | None
    adapter_rc: int | None
    line: str | None  # the first prestartup membackend line of the adapter run
    prestartup_lines: int
    stock_seconds: float
    adapter_seconds: float
    aimdo_stock: str | None
    aimdo_adapter: str | None
    membackend: dict[str, Any] | None
    new_exceptions: list[str]
    problems: list[str]

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = self.case.id
        d.update(flags=" ".join(FLAGS[self.case.flags]), selection=self.case.selection, aimdo=self.case.aimdo)
        return d


def _aimdo_problems(which: str, run: Run, version: str, python: ComfyPython) -> list[str]:
    if run.probe is None:
        return [f"{which}: the run ended without reporting which comfy_aimdo it imported (no clean exit)"]
    got = run.probe.get("aimdo_version")
    out = [] if got == version else [f"{which}: imported comfy_aimdo {got}, not {version}"]
    root = python.aimdo_root(version)
    files = [f for f in run.probe.get("aimdo_files", []) if f.endswith(".py")]
    if root is not None:
        stray = [f for f in files if not Path(f).is_relative_to(root)]
    else:
        stray = [f for f in files if Path(f).is_relative_to(python.venv / "aimdo")]
    if stray:
        out.append(f"{which}: comfy_aimdo modules from elsewhere than comfy-aimdo {version}'s folder: {stray}")
    return out


def judge(case: Case, stock: Run, adapter: Run, python: ComfyPython, trees: tuple[Path, ...] = ()) -> CaseResult:
    """Every way the adapter run breaks the contract, given the stock run with the same flags."""
    want = expected(case)
    problems: list[str] = []
    if stock.rc == 0 and adapter.rc != 0:
        problems.append(f"adapter run exited {adapter.rc} where stock exited 0")
    lines = prestartup_lines(adapter.output)
    line = lines[0] if lines else None
    if len(lines) != 1:
        problems.append(f"{len(lines)} membackend start-up line(s) before the prestartup report, not 1: {lines}")
    if line is not None:
        if len(line) > LINE_LIMIT:
            problems.append(f"the start-up line has {len(line)} characters (at most {LINE_LIMIT})")
        stock_said = "ComfyUI runs stock" in line
        if want.startswith("using "):
            if not re.search(rf"\b{re.escape(want)}\b", line) or stock_said:
                problems.append(f"expected the start-up line to say {want!r} (taking over): {line!r}")
        elif not stock_said or (want == "off" and not re.search(r"\boff\b", line)):
            need = "'off' and 'ComfyUI runs stock'" if want == "off" else "'ComfyUI runs stock'"
            problems.append(f"expected the start-up line to say {need}: {line!r}")
    new = exceptions(adapter.output, *trees) - exceptions(stock.output, *trees)
    if new:
        problems.append(f"tracebacks in the adapter run that stock does not have: {sorted(new)}")
    problems += _aimdo_problems("stock", stock, case.aimdo, python)
    problems += _aimdo_problems("adapter", adapter, case.aimdo, python)
    mb = (adapter.probe or {}).get("membackend")
    if mb is not None and "error" not in mb:
        running = bool(mb.get("armed")) and mb.get("started") is True and not mb.get("aborted")
        if want.startswith("using ") and not running:
            problems.append(f"membackend does not run after start-up although it should take over: {mb}")
        if not want.startswith("using ") and mb.get("armed"):
            problems.append(f"membackend armed itself although ComfyUI should run stock: {mb}")
    return CaseResult(case, want, stock.rc, adapter.rc, line, len(lines), round(stock.seconds, 1),
                      round(adapter.seconds, 1), (stock.probe or {}).get("aimdo_version"),
                      (adapter.probe or {}).get("aimdo_version"), mb, sorted(new), problems)


def run_matrix(cases: list[Case], *, trees: Trees, python: ComfyPython, logs: Path, workers: int = 2
               ) -> dict[Case, CaseResult]:
    """Every case's adapter run and, once per (flags, comfy-aimdo version), its stock run; ``workers`` at a
    time. Each run's output is kept in ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)

    def one(template: Path, label: str, flags: tuple[str, ...], env: dict[str, str], aimdo: str) -> Run:
        with trees.scratch_copy(template, label) as tree:
            run = run_comfyui(tree, flags, env, aimdo, python=python)
        (logs / f"{safe_name(label)}.log").write_text(run.output, encoding="utf-8")
        return run

    stock_keys = sorted({(c.flags, c.aimdo) for c in cases})
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        stock = {k: pool.submit(one, trees.stock, f"stock/{k[0]}/aimdo-{k[1]}", FLAGS[k[0]], {}, k[1])
                 for k in stock_keys}
        adapter = {c: pool.submit(one, trees.node, f"adapter/{c.id}", FLAGS[c.flags], SELECTIONS[c.selection],
                                  c.aimdo) for c in cases}
        return {c: judge(c, stock[(c.flags, c.aimdo)].result(), adapter[c].result(), python,
                         (trees.stock, trees.node, trees.scratch))
                for c in cases}
    except BaseException as exc:  # interrupted, or a run could not start: no child outlives the matrix
        pool.shutdown(wait=False, cancel_futures=True)
        kill_all(stop=isinstance(exc, KeyboardInterrupt))
        raise
    finally:
        pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------- workflows

def empty_image_workflow(prefix: str = "membackend_rc_empty") -> dict[str, Any]:
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                          "color": 0x3366CC}},
            "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}}}


def vae_workflow(vae_name: str = VAE_NAME, prefix: str = "membackend_rc_vae") -> dict[str, Any]:
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                          "color": 0x3366CC}},
            "2": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
            "3": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["2", 0]}},
            "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["2", 0]}},
            "5": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": prefix}}}


WORKFLOWS = {"empty-image": empty_image_workflow, "vae-roundtrip": vae_workflow}


@dataclass
class Served:
    """What one served configuration gave: image hashes per workflow, the status route before and after
    ``POST /free``, or the error that stopped it."""

    name: str
    flags: tuple[str, ...]
    env: dict[str, str]
    node: bool
    hashes: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    status: Any = None
    status_code: int | None = None
    reservations_before_free: int | None = None  # 0 on a CPU device: ComfyUI loads models there stock
    after_free: Any = None
    free_seconds: float | None = None
    exceptions: list[str] = field(default_factory=list)  # each traceback's exception line in the server's log
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return asdict(self)


def run_served(name: str, template: Path, flags: tuple[str, ...], env: dict[str, str], *, trees: Trees,
               python: ComfyPython, logs: Path, free: bool = False) -> Served:
    """Serve ``template`` with ``flags``/``env``, run :data:`WORKFLOWS`, hash their images, read
    ``/membackend/status``; with ``free``, ``POST /free`` and poll the status until no reservation is left
    (at most :data:`FREE_TIMEOUT` s)."""
    got = Served(name, flags, env, template == trees.node)
    log = logs / f"served-{safe_name(name)}.log"
    t0 = time.monotonic()
    try:
        with trees.scratch_copy(template, f"served-{name}") as tree, \
                serve(tree, flags, env, python=python, log=log) as server:
            for wf, make in WORKFLOWS.items():
                images = server.run_prompt(make())
                got.hashes[wf] = sha256(images[0])
            got.status_code, got.status = server.get("/membackend/status")
            if free:
                if isinstance(got.status, dict) and isinstance(got.status.get("reservations"), list):
                    got.reservations_before_free = len(got.status["reservations"])
                status, answer = server.post("/free", {"unload_models": True, "free_memory": True})
                if status != 200:
                    raise HarnessError(f"POST /free answered {status}: {answer}")
                t1 = time.monotonic()
                while True:
                    _, got.after_free = server.get("/membackend/status")
                    left = got.after_free.get("reservations") if isinstance(got.after_free, dict) else None
                    if left == [] or time.monotonic() - t1 > FREE_TIMEOUT:
                        break
                    time.sleep(0.25)
                got.free_seconds = round(time.monotonic() - t1, 2)
    except (HarnessError, OSError, ValueError) as exc:
        got.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HarnessError) else str(exc)
    if log.is_file():
        got.exceptions = sorted(exceptions(log.read_text(encoding="utf-8", errors="replace"),
                                           trees.scratch, trees.stock, trees.node, stopped_by_us=True).elements())
    got.seconds = round(time.monotonic() - t0, 1)
    return got


# ---------------------------------------------------------------------------------------------- start-up cost

COST_CHILD = """if True:
    import json, os, runpy, sys, time
    mode, tree, script, *flags = sys.argv[1:]
    if mode == "torch":
        t0 = time.perf_counter()
        import torch
        print(json.dumps({"seconds": time.perf_counter() - t0}))
        raise SystemExit(0)
    os.chdir(tree)
    sys.path.insert(0, tree)
    sys.argv = ["main.py", *flags]
    # what ComfyUI's main.py does before it runs the prestartup scripts (not counted)
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.cli_args
    import comfy_aimdo.control
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    t0 = time.perf_counter()
    runpy.run_path(script, run_name="membackend_prestartup")
    t1 = time.perf_counter()
    torch_before = "torch" in sys.modules
    import torch
    t2 = time.perf_counter()
    print(json.dumps({"seconds": t1 - t0, "torch_after": t2 - t1, "torch_imported_by_prestartup": torch_before}))
"""

COST_SIDES = {
    "import torch": ("torch", (), {}),
    "prestartup, --cpu (stock)": ("prestartup", ("--cpu",), {}),
    "prestartup, take-over (h200, --cpu --enable-dynamic-vram)":
        ("prestartup", ("--cpu", "--enable-dynamic-vram"), {"MEMBACKEND_SIM_PROFILE": "h200"}),
}

MEASURE_CHILD = """if True:
    import json
    from membackend.lab.startup_cost import measure_startup
    print(json.dumps(measure_startup(rounds=3)))
"""


def measure_cost(tree: Path, *, python: ComfyPython, rounds: int = 5) -> dict[str, Any]:
    """``import torch`` against the installed prestartup script under the real tree's ``sys.path``, each in a
    fresh interpreter, sides alternating, ``rounds`` rounds after one warm-up (which also fills a private
    bytecode cache all sides read); medians and ratios. Also
    :func:`membackend.lab.startup_cost.measure_startup` run in the ComfyUI Python (it adds the
    ``init_devices`` start over stand-ins)."""
    script = tree / "custom_nodes" / "membackend" / "prestartup_script.py"
    seen: dict[str, list[float]] = {k: [] for k in COST_SIDES}
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="membackend-rc-pycache-") as pycache:
        for i in range(rounds + 1):
            for side, (mode, flags, env) in COST_SIDES.items():
                # every side reads compiled bytecode from one private cache, filled by the warm-up round (as
                # membackend.lab.startup_cost does): an editable checkout has none of its own
                env = child_env({**env, "PYTHONPYCACHEPREFIX": pycache})
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                p = run_child([python.path, "-c", COST_CHILD, mode, str(tree), str(script), *flags], cwd=tree,
                              env=env)
                got = json.loads(p.stdout.strip().splitlines()[-1])
                if i == 0:
                    if mode == "prestartup":
                        extra[side] = {"log": membackend_lines(p.stderr),
                                       "torch_imported_by_prestartup": got["torch_imported_by_prestartup"]}
                    continue  # warm-up: not counted
                seen[side].append(got["seconds"])
    torch_s = statistics.median(seen["import torch"])
    rows = {side: {"median_seconds": round(statistics.median(v), 4),
                   "ratio_to_import_torch": round(statistics.median(v) / torch_s, 4),
                   "rounds": [round(x, 4) for x in v]} for side, v in seen.items()}
    for side, info in extra.items():
        rows[side].update(info)
    out: dict[str, Any] = {"rounds": rounds, "rows": rows}
    try:
        p = run_child([python.path, "-c", MEASURE_CHILD], env=child_env(), timeout=600)
        out["measure_startup"] = json.loads(p.stdout.strip().splitlines()[-1])
    except (HarnessError, ValueError) as exc:
        out["measure_startup_error"] = str(exc)[-2000:]
    return out


# ---------------------------------------------------------------------------------------------- comfy_dynamic_vram

DYNAMIC_ARGV: tuple[tuple[str, ...], ...] = (
    (), ("--highvram",), ("--gpu-only",), ("--novram",), ("--lowvram",), ("--disable-dynamic-vram",),
    ("--enable-dynamic-vram",), ("--highvram", "--enable-dynamic-vram"), ("--novram", "--enable-dynamic-vram"),
    ("--cpu",), ("--cpu", "--enable-dynamic-vram"), ("--disable-smart-memory",), ("--reserve-vram", "1"),
    ("--vram-headroom", "1"),
)

DYNAMIC_CHILD = """if True:
    import json, sys
    tree = sys.argv[1]
    cases = json.loads(sys.argv[2])
    sys.path.insert(0, tree)
    sys.argv = ["main.py"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.cli_args as cli
    out = {"cases": []}
    try:
        from membackend._comfyui.startup import comfy_dynamic_vram
    except Exception as exc:
        comfy_dynamic_vram = None
        out["import_error"] = f"{type(exc).__name__}: {exc}"
    for argv in cases:
        cli.args = cli.parser.parse_args(argv)
        row = {"argv": argv, "comfy": cli.enables_dynamic_vram()}
        if comfy_dynamic_vram is not None:
            try:
                got = comfy_dynamic_vram(cli)
                row["answer"] = repr(got)
                if isinstance(got, tuple) and len(got) == 2:
                    row["ours"], row["reason"] = got
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
        out["cases"].append(row)
    print(json.dumps(out, default=repr))
"""


def dynamic_vram_answers(tree: Path, *, python: ComfyPython) -> dict[str, Any]:
    """In one child: for each of :data:`DYNAMIC_ARGV`, ComfyUI's ``enables_dynamic_vram()`` and membackend's
    ``comfy_dynamic_vram(comfy.cli_args)``."""
    p = run_child([python.path, "-c", DYNAMIC_CHILD, str(tree), json.dumps([list(a) for a in DYNAMIC_ARGV])],
                  cwd=tree, env=child_env())
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- report

class Report:
    """The suite's findings in ``folder``: ``report.json`` and ``report.md``, rewritten on every :meth:`put`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {}
        self._lock = threading.Lock()

    def put(self, section: str, value: Any) -> None:
        with self._lock:
            self.data[section] = value
            (self.folder / "report.json").write_text(json.dumps(self.data, indent=2, default=str), encoding="utf-8")
            (self.folder / "report.md").write_text(self.markdown(), encoding="utf-8")

    def markdown(self) -> str:
        out = ["# membackend in a real ComfyUI tree", ""]
        env = self.data.get("environment")
        if env:
            out += [f"- {k}: `{v}`" for k, v in env.items()] + [""]
        matrix = self.data.get("matrix")
        if matrix:
            bad = sum(1 for r in matrix["cases"] if r["problems"])
            out += [f"## Start-up matrix ({matrix['mode']}: {len(matrix['cases'])} adapter runs, "
                    f"{matrix['stock_runs']} stock runs, {matrix['seconds']:.0f} s; {bad} with problems)", "",
                    "| flags | selection | aimdo | expected | stock rc | adapter rc | s (stock/adapter) | "
                    "membackend line | problems |",
                    "|---|---|---|---|---|---|---|---|---|"]
            for r in matrix["cases"]:
                line = (r["line"] or "").replace("|", "\\|")
                probs = "<br>".join(p.replace("|", "\\|")[:300] for p in r["problems"]) or "ok"
                out.append(f"| `{r['flags']}` | {r['selection']} | {r['aimdo']} | {r['expected']} | {r['stock_rc']} "
                           f"| {r['adapter_rc']} | {r['stock_seconds']}/{r['adapter_seconds']} | {line} | {probs} |")
            out.append("")
        served = self.data.get("served")
        if served:
            out += ["## Served workflows (sha256 of the saved PNG)", "",
                    "| configuration | flags | env | node | " + " | ".join(WORKFLOWS) + " | status route | error |",
                    "|---|---|---|---|" + "---|" * len(WORKFLOWS) + "---|---|"]
            for r in served.values():
                st = r.get("status")
                st = (f"{st.get('state')}, running={st.get('running')}" if isinstance(st, dict)
                      else f"{r.get('status_code')}")
                hashes = " | ".join(f"`{r['hashes'].get(w, '-')[:16]}`" for w in WORKFLOWS)
                err = (r.get("error") or "").splitlines()[0][:200] if r.get("error") else ""
                env_s = " ".join(f"{k}={v}" for k, v in r["env"].items())
                out.append(f"| {r['name']} | `{' '.join(r['flags'])}` | {env_s} | {r['node']} | {hashes} | {st} "
                           f"| {err} |")
            out.append("")
            for name, ref in self.data.get("served_references", {}).items():
                out.append(f"- {name} compared with {ref}")
            for r in served.values():
                if r.get("reservations_before_free") is not None:
                    after = r.get("after_free")
                    left = after.get("reservations") if isinstance(after, dict) else after
                    out.append(f"- {r['name']}: {r['reservations_before_free']} reservation(s) before POST /free, "
                               f"{left!r} {r.get('free_seconds')} s after (0 before means nothing was loaded "
                               "dynamically: ComfyUI loads models on a CPU device with its stock patcher)")
            out.append("")
        cost = self.data.get("startup_cost")
        if cost:
            out += [f"## Start-up cost in the real tree (median of {cost['rounds']} rounds, fresh interpreters)", "",
                    "| side | median s | ratio to `import torch` |", "|---|---|---|"]
            for side, row in cost["rows"].items():
                out.append(f"| {side} | {row['median_seconds']:.4f} | {row['ratio_to_import_torch']:.3f} |")
            ms = cost.get("measure_startup")
            if ms:
                out += ["", f"`membackend.lab.startup_cost.measure_startup` in the ComfyUI Python: adapter "
                        f"{ms['adapter_seconds']:.3f} s = {ms['ratio']:.3f} of `import torch` "
                        f"({ms['torch_seconds']:.3f} s; target {ms['target']})"]
            elif cost.get("measure_startup_error"):
                out += ["", f"measure_startup failed: {cost['measure_startup_error'][:300]}"]
            out.append("")
        dyn = self.data.get("comfy_dynamic_vram")
        if dyn:
            out += ["## comfy_dynamic_vram vs ComfyUI's enables_dynamic_vram()", ""]
            if dyn.get("import_error"):
                out += [f"import failed: {dyn['import_error']}", ""]
            out += ["| argv | ComfyUI | membackend | reason |", "|---|---|---|---|"]
            for r in dyn["cases"]:
                ours = r.get("ours", r.get("error", "-"))
                out.append(f"| `{' '.join(r['argv']) or '(none)'}` | {r['comfy']} | {ours} | {r.get('reason', '')} |")
            out.append("")
        return "\n".join(out)


def python_summary(python: ComfyPython) -> dict[str, Any]:
    return {"python": python.path, "torch": python.torch, "comfy-aimdo installed": python.aimdo_installed,
            "extra comfy-aimdo": sorted(p.name for p in (python.venv / "aimdo").glob("*") if p.is_dir()),
            "membackend": python.membackend_file, "harness python": sys.executable}
