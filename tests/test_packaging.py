"""Every distribution installs whole, and every target platform installs from the package index.

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

Offline, the wheels and sdists are checked for what an index page and an install need: the
GPL-3.0 ``LICENSE`` file (``license-files``), the SPDX licence, the project URLs, classifiers,
each distribution's README as its description, every file of the package (data files included),
and the plugins' compatible range of membackend. Every link in the README and in each plugin's
README is relative and names a file or folder of this repository, so it opens in a clone (the
repository's public address in ``pyproject.toml`` is a placeholder until it is published; none
points at it).

The resolving tests and the fresh install ask the package index, so they carry the ``network``
marker (deselect with ``-m "not network"``); where the index cannot be reached they are skipped
with pip's reason. Every pip call of the resolving tests has a timeout and all of them together a
budget (``FILE_BUDGET``). The fresh install builds a virtual environment from the wheels, with
their dependencies, and runs ``membackend doctor``, a replay and the conformance kit from a folder
outside the repository (about two minutes). Run with ``-s`` to see each target's dependency list.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: every platform plugin that ships (each folder of plugins/ with a pyproject.toml): four
PLUGINS = tuple(sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()))
#: the repository's public address (a placeholder until the repository is published): every project URL is
#: on it, and no README link (each is relative, so it opens in a clone)
BASE = "https://github.com/membackend/membackend"
#: the folder of every distribution in this repository: the core, the platform plugins, the example backend
DISTRIBUTIONS = {"membackend": ROOT, **{f"membackend-{p.replace('_', '-')}": ROOT / "plugins" / p for p in PLUGINS},
                 "membackend-memfd": ROOT / "docs" / "examples" / "memfd_backend"}
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
    path: Path | None = None  # the wheel file, for the ones built here


class Unreachable(Exception):
    """pip could not reach the package index."""


_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Could not fetch URL", "Temporary failure in name",
                "Network is unreachable", "ConnectionError", "ReadTimeoutError")


# --------------------------------------------------------------------------- the wheels, built offline


def _metadata(wheel: Path) -> Dist:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(name).decode())
    return Dist(canonicalize_name(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or [], wheel.name, wheel)


def _copy_sources(dest: Path) -> Path:
    """The core and every plugin, copied without build leftovers or tests (the tree stays clean)."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "tests", ".pytest_cache")
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / f, dest / f)
    shutil.copytree(ROOT / "membackend", dest / "membackend", ignore=skip)
    for p in PLUGINS:
        shutil.copytree(ROOT / "plugins" / p, dest / "plugins" / p, ignore=skip)
    return dest


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Dist]:
    """membackend and every plugin as wheels, built from a copy of the sources (the tree stays clean)."""
    pytest.importorskip("setuptools")
    src, out = _copy_sources(tmp_path_factory.mktemp("src")), tmp_path_factory.mktemp("wheels")
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


def _plain(reqs: list[Requirement]) -> set[str]:
    """Each requirement as ``name[extras]``, without its version range."""
    return {r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") for r in reqs}


def test_the_plugins_depend_on_their_platform_extra_and_hip_python_only_where_it_installs(wheels):
    core = wheels["membackend"]
    assert _plain(_wanted(wheels["membackend-rocm-windows"].requires, set(), WINDOWS.env)) == {"membackend[hip]"}
    for plugin in ("membackend-cuda-wddm", "membackend-unified-gb10"):
        assert _plain(_wanted(wheels[plugin].requires, set(), WINDOWS.env)) == {"membackend[cuda]"}

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


def test_the_plugins_depend_on_a_compatible_range_of_membackend(wheels):
    """Any 0.1.x membackend, nothing older, not 0.2 (whose hookspec may differ)."""
    core = Version(wheels["membackend"].version)
    for p in PLUGINS:
        name = canonicalize_name(f"membackend-{p}")
        req = next(r for r in map(Requirement, wheels[name].requires) if canonicalize_name(r.name) == "membackend")
        assert req.specifier.contains(core) and req.specifier.contains("0.1.9"), (name, str(req))
        assert not req.specifier.contains("0.2.0") and not req.specifier.contains("0.0.9"), (name, str(req))


# --------------------------------------------------------------------------- offline: what every distribution carries


def _gpl3(text: str) -> bool:
    return text.lstrip().startswith("GNU GENERAL PUBLIC LICENSE") and "Version 3, 29 June 2007" in text[:200] \
        and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_every_distribution_declares_its_licence_urls_classifiers_and_readme(dist):
    folder = DISTRIBUTIONS[dist]
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["name"] == dist
    assert project["license"] == "GPL-3.0-or-later" and project["license-files"] == ["LICENSE"], project.get("license")
    licence = (folder / "LICENSE").read_text()
    assert _gpl3(licence) and licence == (ROOT / "LICENSE").read_text(), f"{folder / 'LICENSE'} is not the GPL-3.0 text"
    debian = Path("/usr/share/common-licenses/GPL-3")  # the text as Debian ships it, where it does
    if debian.exists():
        assert licence == debian.read_text(), "LICENSE differs from the GPL-3.0 text Debian ships"
    assert project["readme"] == "README.md" and (folder / "README.md").read_text().strip()
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"]), project
    assert not any(c.startswith("License ::") for c in project["classifiers"]), "the SPDX licence replaces these"
    urls = project["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues"}, urls
    for url in urls.values():
        assert url in (BASE, f"{BASE}/issues") or _on_the_address(url), url


def _members(archive: Path) -> dict[str, bytes]:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    with tarfile.open(archive) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_every_wheel_carries_the_licence_the_urls_and_its_readme(wheels):
    licence = (ROOT / "LICENSE").read_bytes()
    folders = {canonicalize_name(d): f for d, f in DISTRIBUTIONS.items()}
    for name, dist in wheels.items():
        files = _members(dist.path)
        info = next(n.split("/")[0] for n in files if n.endswith(".dist-info/METADATA"))
        assert files.get(f"{info}/licenses/LICENSE") == licence, f"{dist.source} has no LICENSE: {sorted(files)}"
        msg = email.parser.Parser().parsestr(files[f"{info}/METADATA"].decode())
        assert msg["License-Expression"] == "GPL-3.0-or-later" and msg["License-File"] == "LICENSE", dist.source
        urls = dict(u.split(", ", 1) for u in msg.get_all("Project-URL") or [])
        assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls), (dist.source, urls)
        assert all(u.startswith(BASE) for u in urls.values()), urls
        assert len(msg.get_all("Classifier") or []) >= 5, dist.source
        assert msg["Description-Content-Type"] == "text/markdown", dist.source
        readme = (folders[name] / "README.md").read_text()
        assert msg.get_payload().strip() == readme.strip(), f"{dist.source}: the description is not its README"


def test_every_sdist_carries_the_licence_and_the_readme(tmp_path):
    src = _copy_sources(tmp_path / "src")
    for folder in [src, *(src / "plugins" / p for p in PLUGINS)]:
        out = tmp_path / "sdists" / folder.name
        code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
        p = subprocess.run([sys.executable, "-c", code, str(out)], cwd=folder, capture_output=True, text=True,
                           timeout=180)
        assert p.returncode == 0, f"building the sdist of {folder.name} failed:\n{p.stderr[-2000:]}"
        sdist = out / p.stdout.strip().splitlines()[-1]
        files = _members(sdist)
        assert files.get("LICENSE") == (ROOT / "LICENSE").read_bytes(), f"{sdist.name}: {sorted(files)[:20]}"
        assert files.get("README.md") == (folder / "README.md").read_bytes(), sdist.name
        assert not [n for n in files if n.endswith(".pyc") or "__pycache__" in n], sdist.name


def _package_files(folder: Path) -> set[str]:
    return {p.relative_to(folder.parent).as_posix() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_the_wheels_hold_every_file_of_their_packages(wheels):
    """Data files too (the ComfyUI panel's web files): a wheel that drops one breaks an install, not a test."""
    core = set(_members(wheels["membackend"].path))
    missing = _package_files(ROOT / "membackend") - core
    assert not missing, f"the membackend wheel lacks {sorted(missing)}"
    assert not [n for n in core if n.endswith(".pyc") or "__pycache__" in n]
    for p in PLUGINS:
        package = next((ROOT / "plugins" / p).glob("membackend_*/__init__.py")).parent
        missing = _package_files(package) - set(_members(wheels[canonicalize_name(f"membackend-{p}")].path))
        assert not missing, f"the {p} wheel lacks {sorted(missing)}"


def test_package_data_takes_any_file_under_membackend_and_no_bytecode(tmp_path):
    """The rule in pyproject.toml itself, on files that need not exist today: a file of any kind in a
    folder without ``__init__.py``, nested, ships; a bytecode cache does not."""
    src = _copy_sources(tmp_path / "src")
    for p in PLUGINS:
        shutil.rmtree(src / "plugins" / p)
    data = src / "membackend" / "_comfyui" / "web" / "assets" / "deep" / "probe.woff2"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_bytes(b"\x00font")
    (src / "membackend" / "__pycache__").mkdir(exist_ok=True)
    (src / "membackend" / "__pycache__" / "stale.cpython-311.pyc").write_bytes(b"pyc")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "-w", str(out), str(src)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    files = _members(next(out.glob("membackend-*.whl")))
    assert files.get("membackend/_comfyui/web/assets/deep/probe.woff2") == b"\x00font", sorted(files)[:40]
    assert not [n for n in files if n.endswith(".pyc")], [n for n in files if n.endswith(".pyc")]


# --------------------------------------------------------------------------- offline: links on the index's page

#: every README an index page shows: the core's, each plugin's, the example backend's
READMES = ["README.md", *(f"plugins/{p}/README.md" for p in PLUGINS), "docs/examples/memfd_backend/README.md"]
_LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""\b(href|src)\s*=\s*["']([^"']+)["']""")


def _links(text: str, images: bool | None = None) -> list[str]:
    """Every link target of a Markdown text, outside code blocks and code spans; ``images`` True: only
    pictures (``![..](..)``, ``src=``), False: only the others, None: all."""
    text = re.sub(r"(?ms)^(```|~~~).*?^\1", "", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = [(bang == "!", url) for bang, url in _LINK.findall(text)]
    found += [(attr == "src", url) for attr, url in _HTML_LINK.findall(text)]
    return [url for picture, url in found if images is None or picture == images]


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchor of every heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"(?ms)^(```|~~~).*?^\1", "", markdown)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"(?m)^#{1,6}\s+(.+?)\s*#*$", text.replace("`", ""))}


def _on_the_address(url: str) -> bool:
    """Whether ``url`` names a folder (``/tree/main/``) or file (``/blob/main/``) of this repository on its address."""
    for kind, is_file in (("tree", False), ("blob", True)):
        path = url.removeprefix(f"{BASE}/{kind}/main/")
        if path != url and (ROOT / path).exists() and (ROOT / path).is_file() == is_file:
            return True
    return False


def _target(url: str, readme: Path) -> tuple[Path, str]:
    """The file or folder of this repository a relative link of ``readme`` names, and its anchor;
    AssertionError when it names none (or points at the placeholder address, or out of the repository)."""
    assert not url.startswith(BASE), f"{url} points at {BASE}, a placeholder: link relatively (docs/...)"
    path, _, anchor = url.partition("#")
    target = (readme.parent / path).resolve() if path else readme
    assert target == ROOT or ROOT in target.parents, f"{url} leaves the repository"
    assert target.exists(), f"{url} names {target.relative_to(ROOT)}, which is not in this repository"
    return target, anchor


@pytest.mark.parametrize("readme", READMES)
def test_every_readme_link_is_relative_and_names_a_file_of_this_repository(readme):
    text = (ROOT / readme).read_text()
    for url in _links(text):
        if url.startswith(("https://", "http://")) and not url.startswith(BASE):
            assert url.startswith("https://"), f"{readme}: {url} is not https"
            continue
        target, anchor = _target(url, ROOT / readme)
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target.read_text()), f"{readme}: {url}: no heading #{anchor} in {target.name}"
    if readme == "README.md":
        assert len(_links(text)) >= 10, _links(text)


def test_the_link_check_refuses_what_does_not_open_in_a_clone():
    text = "see [a](docs/a.md), ![p](x.png), `[code](no.md)`, <a href='y.md'>y</a> <img src=\"z.png\">"
    assert _links(text) == ["docs/a.md", "x.png", "y.md", "z.png"]
    assert _links(text, images=True) == ["x.png", "z.png"] and _links(text, images=False) == ["docs/a.md", "y.md"]
    readme = ROOT / "README.md"
    for bad in ("docs/no-such-page.md", f"{BASE}/blob/main/docs/architecture.md", "../outside.md"):
        with pytest.raises(AssertionError):
            _target(bad, readme)
    assert _target("docs/architecture.md#the-layers", readme) == (ROOT / "docs" / "architecture.md", "the-layers")


def test_the_readme_indexes_every_page_of_docs():
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    missing = [p for p in pages if f"](docs/{p})" not in readme]
    assert not missing, f"docs/ pages missing from the README's index: {missing}"


# --------------------------------------------------------------------------- through the package index: a fresh install


def _venv_pip(python: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """This environment's pip installing into the virtual environment of ``python`` (which has none)."""
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.skip(f"the package index answered too slowly: pip took more than {timeout} s")
    text = p.stdout + p.stderr
    if p.returncode and any(s in text for s in _UNREACHABLE) and "No matching distribution" not in text:
        pytest.skip(f"the package index cannot be reached: {text.strip().splitlines()[-1]}")
    assert p.returncode == 0, f"pip install {' '.join(args)} failed:\n{text[-3000:]}"
    return p


@pytest.mark.network
@pytest.mark.long
def test_a_fresh_venv_from_the_wheels_runs_doctor_a_replay_and_the_kit_from_another_folder(wheels, tmp_path):
    """``pip install membackend`` (no extras; ``[kit]`` only for the kit's pytest and hypothesis), then the
    three plugins, into a virtual environment made here; every command runs in a folder outside the
    repository, with no ``PYTHONPATH`` and no ``MEMBACKEND_*`` variable."""
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python, cli = bindir / "python", bindir / "membackend"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMBACKEND_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}

    def run(*cmd: str | Path, timeout: int = 300) -> str:
        p = subprocess.run([str(c) for c in cmd], cwd=elsewhere, env=env, capture_output=True, text=True,
                           timeout=timeout)
        shown = " ".join(map(str, cmd))
        assert p.returncode == 0, f"{shown} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}"
        return p.stdout

    _venv_pip(python, f"{wheels['membackend'].path}[kit]")
    where = run(python, "-c", "import membackend, sys; print(membackend.__file__); print(sys.prefix)").split()
    assert Path(where[0]).is_relative_to(venv) and not Path(where[0]).is_relative_to(ROOT), where
    bare = run(python, "-c", "import importlib.util as u; print([m for m in ('cuda', 'hip', 'numpy', 'torch') "
                             "if u.find_spec(m)])")
    assert bare.strip() == "[]", f"the plain install brought GPU bindings: {bare}"  # else it proves nothing

    doctor = run(cli, "doctor")
    assert "self-test: passed" in doctor and "selected: host" in doctor, doctor[-2000:]
    replay = run(cli, "replay", "churn-wddm", "--profile", "wddm-6gb", "--seeds", "1")
    assert "stock reproduces the reported failure: yes" in replay, replay[-2000:]
    kit = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "membackend.testing.conformance",
              "--membackend-backend", "host", "--membackend-examples", "5")
    gaps = [x for x in kit.splitlines() if x.startswith("membackend kit: host: not checked:")]
    # the one gap the host backend has by design: its injection never fails a page drop (madvise(MADV_DONTNEED)
    # fails only on programming errors), so no free stops part-way
    assert "membackend kit: host: checked:" in kit and gaps == [
        "membackend kit: host: not checked: partial frees (dropped page by page) (no injected failure stopped a "
        "free part-way in 24 tries (does membackend_inject_failures fail page drops?))"], kit[-2000:]

    _venv_pip(python, *(str(wheels[canonicalize_name(f"membackend-{p}")].path) for p in PLUGINS))
    found = {row["name"]: row for row in json.loads(run(cli, "backends", "--json"))["backends"]}
    for p in PLUGINS:
        assert found.get(p, {}).get("origin", "").startswith(f"entry point {p} = "), (p, found.get(p))
    replay = run(cli, "replay", "churn-wddm", "--profile", "wddm-6gb", "--seeds", "1")
    assert "plugin (cuda_wddm)" in replay and "plugin holds G2: yes" in replay, replay[-2000:]


# --------------------------------------------------------------------------- through the package index


@pytest.mark.network
@pytest.mark.long
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
@pytest.mark.long
def test_hip_python_itself_has_no_windows_install_so_the_marker_is_needed(tmp_path):
    """The reason for the marker: hip-python 6.2 and later do not resolve for win_amd64 (the
    rocm-bindings they need have no Windows wheel; an unmarked, unversioned `hip-python` there
    would pick the 0.0.2 placeholder)."""
    try:
        with pytest.raises(LookupError, match="cannot install"):
            resolve(["hip-python>=6.2"], WINDOWS, {}, tmp_path)
    except Unreachable as exc:
        pytest.skip(f"the package index cannot be reached: {exc}")
