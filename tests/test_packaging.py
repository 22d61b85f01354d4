"""Every target platform installs from the package index (issue 17, deliver 4).

The core and each platform plugin are built into wheels (offline: setuptools from this
environment, no build isolation), then their installs are resolved for the platform each
one is meant for, with ``pip install --dry-run --report --platform ... --only-binary=:all:``:

* ``win_amd64``: Windows + RTX 3050 under WDDM (``membackend-cuda-wddm``) and Windows +
  2x RX 9070 XT (``membackend-rocm-windows``: no hip-python, whose rocm-bindings-hip/-core have
  no Windows wheels);
* ``manylinux_2_28_x86_64``: Linux + H200 (``membackend[cuda]``), Linux ROCm (``[hip]``), the
  development machine (``[test]``);
* ``manylinux_2_28_aarch64``: DGX Spark GB10 (``membackend-unified-gb10``).

pip's ``--platform`` picks wheels by the target's tags but evaluates environment markers
against the machine it runs on, so the resolution here walks the requirements itself:
every ``Requires-Dist`` marker is evaluated with ``packaging.markers`` for the target
platform, and pip (``--no-deps``, one call per level of the dependency tree) chooses the
version and wheel of each third-party requirement for the target's tags. membackend's own
distributions come from the wheels built here (pure Python: they install everywhere).

The resolving tests ask the package index, so they carry the ``network`` marker (deselect
with ``-m "not network"``); where the index cannot be reached they are skipped with pip's
reason. Every pip call has a timeout and all of them together a budget (``FILE_BUDGET``): the
file takes about a minute. Run with ``-s`` to see each target's dependency list.
"""

from __future__ import annotations

import email.parser
import json
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ("cuda_wddm", "rocm_windows", "unified_gb10")
PIP_TIMEOUT = 90  # seconds for one pip call (a cold index cache fetches every wheel's metadata)
FILE_BUDGET = 170  # seconds for every pip call of this file together; past it the rest is skipped
_deadline: list[float] = []


def _manylinux(arch: str) -> list[str]:
    """The tags a glibc 2.28 machine accepts, newest first (pip's --platform does not expand them)."""
    return [f"manylinux_2_{minor}_{arch}" for minor in range(28, 16, -1)] + [f"manylinux2014_{arch}"]


def _env(sys_platform: str, system: str, os_name: str, machine: str) -> dict[str, str]:
    return {"sys_platform": sys_platform, "platform_system": system, "os_name": os_name,
            "platform_machine": machine, "python_version": "3.11", "python_full_version": "3.11.9",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "implementation_version": "3.11.9", "platform_release": "", "platform_version": ""}


@dataclass(frozen=True)
class Target:
    """A platform: its wheel tags and the marker environment of a Python 3.11 there."""

    name: str
    tags: tuple[str, ...]
    env: dict[str, str] = field(hash=False)


WINDOWS = Target("win_amd64", ("win_amd64",), _env("win32", "Windows", "nt", "AMD64"))
LINUX = Target("manylinux_2_28_x86_64", tuple(_manylinux("x86_64")), _env("linux", "Linux", "posix", "x86_64"))
GB10 = Target("manylinux_2_28_aarch64", tuple(_manylinux("aarch64")), _env("linux", "Linux", "posix", "aarch64"))

#: what is installed where: each plugin on its platform, the core's extras on every platform they serve;
#: the installs of one group are resolved together (`cuda12` alone: with `cuda` it would pull 13.x down)
INSTALLS: dict[Target, list[list[str]]] = {
    WINDOWS: [["membackend", "membackend[cuda]", "membackend[hip]", "membackend[aimdo]", "membackend-cuda-wddm",
               "membackend-rocm-windows"], ["membackend[cuda12]"]],
    LINUX: [["membackend", "membackend[cuda]", "membackend[hip]", "membackend[aimdo]", "membackend[test]"],
            ["membackend[cuda12]"]],
    GB10: [["membackend", "membackend[cuda]", "membackend[aimdo]", "membackend-unified-gb10"], ["membackend[cuda12]"]],
}

#: the HIP bindings (hip-python is pure Python; the rocm-bindings it needs have Linux x86_64 wheels only)
HIP_PYTHON = {"hip-python", "rocm-bindings-hip", "rocm-bindings-core"}


@dataclass
class Dist:
    name: str
    version: str
    requires: list[str]
    source: str


class Unreachable(Exception):
    """pip could not reach the package index."""


_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Could not fetch URL", "Temporary failure in name",
                "Network is unreachable", "ConnectionError", "ReadTimeoutError")


# --------------------------------------------------------------------------- the wheels, built offline


def _metadata(wheel: Path) -> Dist:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(name).decode())
    return Dist(canonicalize_name(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or [], wheel.name)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Dist]:
    """membackend and every plugin as wheels, built from a copy of the sources (the tree stays clean)."""
    pytest.importorskip("setuptools")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "tests", ".pytest_cache")
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "membackend", src / "membackend", ignore=skip)
    for p in PLUGINS:
        shutil.copytree(ROOT / "plugins" / p, src / "plugins" / p, ignore=skip)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
           "-w", str(out), str(src)] + [str(src / "plugins" / p) for p in PLUGINS]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"building the wheels failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    dists = {d.name: d for d in map(_metadata, sorted(out.glob("*.whl")))}
    assert set(dists) == {"membackend", *(canonicalize_name(f"membackend-{p}") for p in PLUGINS)}, dists
    return dists


# --------------------------------------------------------------------------- resolving for a platform


def _wanted(requires: list[str], extras: set[str], env: dict[str, str]) -> list[Requirement]:
    """The requirements among ``requires`` that apply on ``env`` with ``extras`` requested."""
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ({""} | extras)):
            out.append(req)
    return out


def _pip_choose(reqs: list[Requirement], target: Target, workdir: Path) -> dict[str, Dist]:
    """pip's choice of version and wheel for each requirement on ``target`` (no dependencies)."""
    report = workdir / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
           "--report", str(report), "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
           "--target", str(workdir / "target")]
    for tag in target.tags:
        cmd += ["--platform", tag]
    cmd += [f"{r.name}{r.specifier}" for r in reqs]
    if not _deadline:
        _deadline.append(time.monotonic() + FILE_BUDGET)
    left = min(PIP_TIMEOUT, _deadline[0] - time.monotonic())
    if left <= 0:
        raise Unreachable(f"the index answered too slowly: this file's {FILE_BUDGET} s for pip are spent")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        raise Unreachable(f"pip took more than {left:.0f} s for {' '.join(cmd[-len(reqs):])}") from None
    if p.returncode:
        text = p.stdout + p.stderr
        if any(s in text for s in _UNREACHABLE) and "No matching distribution" not in text:
            raise Unreachable(text.strip().splitlines()[-1])
        errors = "\n".join(line for line in text.splitlines() if not line.startswith("WARNING: Location"))
        raise LookupError(f"pip cannot install {', '.join(map(str, reqs))} on {target.name}:\n{errors[-3000:]}")
    chosen = {}
    for item in json.loads(report.read_text())["install"]:
        md = item["metadata"]
        chosen[canonicalize_name(md["name"])] = Dist(canonicalize_name(md["name"]), md["version"],
                                                     md.get("requires_dist") or [],
                                                     item.get("download_info", {}).get("url", "").rsplit("/", 1)[-1])
    return chosen


def _requested(dist: Dist, extras: set[str], known: set[str] | None, env: dict[str, str]) -> list[Requirement]:
    """What ``dist`` requires once ``extras`` are asked for, given ``known``, those asked for before
    (None: the dist was not expanded yet, so its unconditional requirements come too)."""
    if known is None:
        return _wanted(dist.requires, extras, env)
    base = {str(r) for r in _wanted(dist.requires, known, env)}
    return [r for r in _wanted(dist.requires, extras | known, env) if str(r) not in base]


def resolve(roots: list[str], target: Target, local: dict[str, Dist], workdir: Path,
            preset: dict[str, Dist] | None = None) -> dict[str, Dist]:
    """Every distribution the installs ``roots`` need on ``target``; LookupError when one has no wheel there.

    Breadth first: the requirements of one level go to pip together; a later requirement of a
    name already chosen must accept the chosen version (pip's resolver is not re-run, so a
    conflict between levels is reported, not backtracked). ``preset``: choices made already (another
    resolution's for the same platform), checked against every requirement like pip's own.
    """
    chosen: dict[str, Dist] = dict(preset or {})
    expanded: dict[str, set[str]] = {}
    level = [Requirement(r) for r in roots]
    while level:
        new: dict[str, list[Requirement]] = {}
        expand: list[tuple[str, set[str]]] = []
        for req in level:
            name = canonicalize_name(req.name)
            if name in chosen and name not in local:
                if not req.specifier.contains(Version(chosen[name].version), prereleases=True):
                    raise LookupError(f"{req} conflicts with {name} {chosen[name].version}, chosen for another "
                                      f"requirement on {target.name}")
                expand.append((name, set(req.extras)))
            elif name in local:
                chosen[name] = local[name]
                expand.append((name, set(req.extras)))
            else:
                new.setdefault(name, []).append(req)
        if new:
            picked = _pip_choose([r for rs in new.values() for r in rs], target, workdir)
            missing = set(new) - set(picked)
            assert not missing, f"pip chose nothing for {missing}"
            chosen.update(picked)
            expand += [(name, set(r.extras)) for name, rs in new.items() for r in rs]
        level = []
        for name, extras in expand:
            known = expanded.get(name)
            if known is not None and extras <= known:
                continue
            level += _requested(chosen[name], extras, known, target.env)
            expanded[name] = (known or set()) | extras
    return chosen


def closure(root: str, chosen: dict[str, Dist], env: dict[str, str]) -> dict[str, str]:
    """``name -> version`` of everything the install ``root`` brings, from a resolution's choices."""
    expanded: dict[str, set[str]] = {}
    stack = [Requirement(root)]
    while stack:
        req = stack.pop()
        name, extras = canonicalize_name(req.name), set(req.extras)
        known = expanded.get(name)
        if known is not None and extras <= known:
            continue
        stack += _requested(chosen[name], extras, known, env)
        expanded[name] = (known or set()) | extras
    return {n: chosen[n].version for n in sorted(expanded)}


# --------------------------------------------------------------------------- offline: the declared markers


def test_the_plugins_depend_on_their_platform_extra_and_hip_python_only_where_it_installs(wheels):
    core = wheels["membackend"]
    assert {str(r) for r in _wanted(wheels["membackend-rocm-windows"].requires, set(), WINDOWS.env)} == \
        {"membackend[hip]"}
    for plugin in ("membackend-cuda-wddm", "membackend-unified-gb10"):
        assert {str(r) for r in _wanted(wheels[plugin].requires, set(), WINDOWS.env)} == {"membackend[cuda]"}

    def names(extra: str, target: Target) -> set[str]:
        reqs = [r for r in _wanted(core.requires, {extra}, target.env) if r.marker is not None]
        return {canonicalize_name(r.name) for r in reqs}

    assert names("hip", WINDOWS) == names("hip", GB10) == {"numpy"}  # the ctypes path on Windows needs nothing
    assert names("hip", LINUX) == {"hip-python", "numpy"}
    for target in (WINDOWS, LINUX, GB10):
        assert {"cuda-python", "numpy"} <= names("cuda", target)
        assert not HIP_PYTHON & names("test", target) or target is LINUX
        cuda = next(r for r in _wanted(core.requires, {"cuda"}, target.env) if r.name == "cuda-python")
        assert cuda.specifier.contains("12.6.0") and cuda.specifier.contains("13.4.4") and \
            not cuda.specifier.contains("14.0.0") and not cuda.specifier.contains("12.5.0"), cuda


# --------------------------------------------------------------------------- through the package index


@pytest.mark.network
@pytest.mark.parametrize("target", list(INSTALLS), ids=lambda t: t.name)
def test_every_install_resolves_for_its_platform(wheels, target, tmp_path):
    print(f"\n{target.name}:")
    first: dict[str, Dist] = {}
    for roots in INSTALLS[target]:
        # a later group reuses the first one's choices but for the CUDA bindings it pins differently
        preset = {n: d for n, d in first.items() if not n.startswith("cuda-")}
        try:
            chosen = resolve(roots, target, wheels, tmp_path, preset)
        except Unreachable as exc:
            pytest.skip(f"the package index cannot be reached: {exc}")
        for root in roots:
            deps = closure(root, chosen, target.env)
            print(f"  {root}: " + ", ".join(f"{n}=={v}" for n, v in deps.items()))
            if target is WINDOWS or target is GB10:
                assert not HIP_PYTHON & set(deps), f"{root} on {target.name} brings {HIP_PYTHON & set(deps)}"
            if "cuda" in root or root in ("membackend-cuda-wddm", "membackend-unified-gb10"):
                assert {"cuda-python", "cuda-bindings", "numpy"} <= set(deps), (root, deps)
                major = Version(deps["cuda-python"]).major
                assert major == (12 if "cuda12" in root else 13), (root, deps["cuda-python"])
            if root in ("membackend[hip]", "membackend-rocm-windows"):
                assert "numpy" in deps and (("hip-python" in deps) == (target is LINUX)), (root, deps)
        _installable_here(chosen, wheels, target)
        first = first or chosen


def _installable_here(chosen: dict[str, Dist], local: dict[str, Dist], target: Target) -> None:
    """Every third-party wheel chosen is one this platform installs."""
    for name, dist in chosen.items():
        if name in local:
            continue
        tag = dist.source.removesuffix(".whl").rsplit("-", 1)[-1]
        assert tag == "any" or any(t in tag.split(".") for t in target.tags), (name, dist.source, target.name)


@pytest.mark.network
def test_hip_python_itself_has_no_windows_install_so_the_marker_is_needed(tmp_path):
    """The reason for the marker: hip-python 6.2 and later do not resolve for win_amd64 (the
    rocm-bindings they need have no Windows wheel; an unmarked, unversioned `hip-python` there
    would pick the 0.0.2 placeholder)."""
    try:
        with pytest.raises(LookupError, match="cannot install"):
            resolve(["hip-python>=6.2"], WINDOWS, {}, tmp_path)
    except Unreachable as exc:
        pytest.skip(f"the package index cannot be reached: {exc}")
