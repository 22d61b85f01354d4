"""``membackend comfyui install|uninstall <ComfyUI folder>``: the custom node that starts membackend.

``install`` writes ``custom_nodes/membackend/`` with two small files:

* ``prestartup_script.py`` — ComfyUI runs it before importing torch; it calls
  :func:`membackend._comfyui.startup.prestartup`, which selects the backend and
  logs one line;
* ``__init__.py`` — loaded with the custom nodes; it registers the
  ``GET /membackend/status`` and ``POST /membackend/headroom`` routes when ComfyUI's
  server exists, and sets ``WEB_DIRECTORY`` to the memory panel's folder inside the
  installed membackend package (ComfyUI serves it under ``/extensions/membackend/``).

Both files only import membackend inside ``try``: a missing or broken
membackend leaves ComfyUI starting stock. Both commands are idempotent
and touch only what ``install`` writes: the node folder, those two files
(a file is ours when it starts with :data:`MARKER`) and, on ``uninstall``,
their ``__pycache__/*.pyc``. They never write, read or delete through a
symbolic link, and nothing outside ``custom_nodes/membackend`` is changed
(``custom_nodes`` itself may be a link to a folder; users share it so).

Refusals, each a :class:`~membackend.types.MembackendError` (the CLI exits 2)
that leaves everything as it was:

* :class:`NotComfyUI` — the folder is not a ComfyUI checkout, or cannot be
  looked into (a part of its path too long for the file system, a folder on the
  way this user may not search);
* :class:`UnsafeLayout` — a link, or a file where a folder belongs (or the
  reverse): ``custom_nodes``, the node folder or one of the two files;
* :class:`ForeignFolder` — one of the two files exists and was not written
  by ``install`` (``install`` never overwrites it; ``uninstall`` refuses a
  folder that holds none of ours);
* :class:`CannotWrite` — a path could not be read, written or removed
  (permissions, disk full); ``install`` first removes what it had created.

``uninstall`` leaves every other file in the node folder where it is and
reports them in :attr:`Outcome.left`; the folder goes only once it is empty.
"""

from __future__ import annotations

import os
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from .._settings.rules import os_reason, shown
from ..types import _CannotWrite as CannotWrite
from ..types import _ForeignFolder as ForeignFolder
from ..types import _NotComfyUI as NotComfyUI
from ..types import _UnsafeLayout as UnsafeLayout

__all__ = ["NotComfyUI", "ForeignFolder", "UnsafeLayout", "CannotWrite", "Outcome", "install", "uninstall",
           "is_comfyui", "NODE_DIR", "MARKER"]

NODE_DIR = "membackend"
MARKER = "# membackend custom node: written by `membackend comfyui install`"
REQUIRED = ("main.py", "comfy/model_management.py", "custom_nodes")
PYCACHE = "__pycache__"
# Windows has no O_NOFOLLOW: there the lstat checks stand alone, and os.replace/os.unlink act on a
# link itself, never on what it points to.
_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


@dataclass(frozen=True)
class Outcome:
    """What :func:`install` or :func:`uninstall` did.

    ``node``: the node folder; ``changed``: whether anything was written or removed; ``left``: after
    ``uninstall``, the names still in the node folder that membackend did not write, sorted (a folder
    ends in ``/``), empty after ``install``.
    """

    node: Path
    changed: bool
    left: tuple[str, ...] = ()


PRESTARTUP = f'''{MARKER}
# ComfyUI runs this before it imports torch. membackend must never stop ComfyUI from starting:
# whatever goes wrong here is logged in one line and ComfyUI carries on stock.
try:
    from membackend._comfyui.startup import prestartup as _membackend_prestartup

    _membackend_prestartup()
except Exception as _exc:  # noqa: BLE001
    import logging as _logging

    _logging.getLogger("membackend").warning(
        "membackend: not started (%s: %s); ComfyUI runs stock", type(_exc).__name__, _exc)
'''

INIT = f'''{MARKER}
# Loaded with the custom nodes; no nodes of its own. Registers GET /membackend/status and
# POST /membackend/headroom, and gives ComfyUI the memory panel (WEB_DIRECTORY, served under
# /extensions/membackend/).
NODE_CLASS_MAPPINGS = {{}}
NODE_DISPLAY_NAME_MAPPINGS = {{}}
try:
    from membackend._comfyui.status import register_routes as _membackend_routes
    from membackend._comfyui.status import web_directory as _membackend_web

    WEB_DIRECTORY = _membackend_web()
    _membackend_routes()
except Exception as _exc:  # noqa: BLE001
    import logging as _logging

    _logging.getLogger("membackend").warning(
        "membackend: status route or memory panel not registered (%s: %s)", type(_exc).__name__, _exc)
'''

FILES = {"prestartup_script.py": PRESTARTUP, "__init__.py": INIT}


def _exists(path: Path) -> bool:
    """Whether ``path`` is there (following links); :class:`NotComfyUI` for one that cannot be looked up at
    all (a part of it longer than the file system allows, a folder on the way this user may not search, a
    NUL byte), which ``Path.exists`` would raise as a bare ``OSError``."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError) as exc:
        why = os_reason(exc) if isinstance(exc, OSError) else "not a path (it holds a NUL byte)"
        raise NotComfyUI(f"{shown(path)} cannot be looked up: {why}; nothing was changed; accepted: the folder of "
                         f"a ComfyUI checkout this user can read (it holds {', '.join(REQUIRED)})") from None
    return True


def is_comfyui(folder: Path) -> list[str]:
    """What ``folder`` lacks to be a ComfyUI checkout (empty: it is one); :class:`NotComfyUI` when it
    cannot be looked into."""
    return [name for name in REQUIRED if not _exists(folder / name)]


def _check(folder: str | Path) -> Path:
    path = Path(folder).expanduser()
    if not _exists(path) or not path.is_dir():
        raise NotComfyUI(f"{shown(path)} is not a folder; accepted: the folder of a ComfyUI checkout "
                         f"(it holds {', '.join(REQUIRED)})")
    missing = is_comfyui(path)
    if missing:
        raise NotComfyUI(f"{shown(path)} is not a ComfyUI checkout: no {', '.join(missing)}; accepted: the folder "
                         f"that holds {', '.join(REQUIRED)} (for the portable build, its ComfyUI subfolder)")
    return path


def _failed(verb: str, path: Path, exc: OSError, tail: str) -> CannotWrite:
    return CannotWrite(f"could not {verb} {shown(path)} ({type(exc).__name__}: {os_reason(exc)}); {tail}; "
                       f"expected: a custom_nodes folder this user can write")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _failed("read", path, exc, "nothing was changed") from None


def _what(path: Path, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link to {shown(os.readlink(path))}"
        except OSError:
            return "a symbolic link"
    return "a folder" if stat.S_ISDIR(st.st_mode) else "a file" if stat.S_ISREG(st.st_mode) else "a special file"


def _node(folder: str | Path, action: str) -> tuple[Path, bool]:
    """The node folder and whether it exists; raises unless it is absent or a real folder."""
    custom = _check(folder) / "custom_nodes"
    if not custom.is_dir():
        raise UnsafeLayout(f"{shown(custom)} is {_what(custom, os.lstat(custom))}; expected ComfyUI's custom_nodes "
                           f"folder (or a link to one); nothing was changed")
    node = custom / NODE_DIR
    st = _lstat(node)
    if st is not None and not stat.S_ISDIR(st.st_mode):  # lstat: a link to a folder is not S_ISDIR
        fix = "remove the link" if stat.S_ISLNK(st.st_mode) else "move it away"
        raise UnsafeLayout(f"{shown(node)} is {_what(node, st)}; expected a folder written by `membackend comfyui "
                           f"install`; nothing was changed; {fix}, then {action} again")
    return node, st is not None


def _scan(node: Path, action: str) -> dict[str, bytes | None]:
    """Each of our two files' bytes (None: absent); raises :class:`UnsafeLayout` for a link or a non-file."""
    found: dict[str, bytes | None] = {}
    for name in FILES:
        path = node / name
        st = _lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            fix = "remove the link" if stat.S_ISLNK(st.st_mode) else "move it away"
            raise UnsafeLayout(f"{shown(path)} is {_what(path, st)}; expected a file written by `membackend comfyui "
                               f"install`; nothing was changed; {fix}, then {action} again")
        try:
            found[name] = None if st is None else _read(path)
        except OSError as exc:
            raise _failed("read", path, exc, "nothing was changed") from None
    return found


def _read(path: Path) -> bytes:
    with os.fdopen(os.open(path, _READ), "rb") as f:
        return f.read()


def _ours(data: bytes | None) -> bool:
    return data is not None and data.startswith(MARKER.encode())


def _stage(node: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to a new temporary file next to ``name``; O_EXCL refuses any existing path or link."""
    tmp = node / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, _CREATE, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def install(folder: str | Path) -> Outcome:
    """Write the custom node; ``changed`` is False when it was already installed.

    Creates the node folder if absent, then writes each of the two files that is missing or differs from
    this version (into a temporary file, then ``os.replace``: a link in its place is replaced, never
    followed). A node folder holding neither file is taken over (nothing in it is overwritten); one holding
    either file without :data:`MARKER` raises :class:`ForeignFolder`. On a write error everything this call
    created is removed again, earlier versions are put back, and :class:`CannotWrite` is raised.
    """
    node, exists = _node(folder, "install")
    found = _scan(node, "install") if exists else dict.fromkeys(FILES)
    foreign = [name for name, data in found.items() if data is not None and not _ours(data)]
    if foreign:
        raise ForeignFolder(f"{shown(node)} exists and was not written by membackend ({', '.join(foreign)} without its "
                            f"marker line); expected: no such file, or the one `membackend comfyui install` "
                            f"writes; nothing was changed; move the folder away, then install again")
    todo = {name: text.encode() for name, text in FILES.items() if found[name] != text.encode()}
    if not todo:
        return Outcome(node, False)
    staged: dict[str, Path] = {}
    done: list[str] = []
    made = False  # whether this call created the node folder
    at = node
    try:
        if not exists:
            os.mkdir(node)
            made = True
        for name, data in todo.items():
            at = node / name
            staged[name] = _stage(node, name, data)
        for name, tmp in staged.items():
            at = node / name
            os.replace(tmp, at)
            done.append(name)
    except OSError as exc:
        stuck = _undo(node, made, found, staged, done)
        tail = f"could not undo: {', '.join(map(str, stuck))}" if stuck else "nothing was changed"
        raise _failed("write", at, exc, tail) from None
    return Outcome(node, True)


def _undo(node: Path, made: bool, found: dict[str, bytes | None], staged: dict[str, Path],
          done: list[str]) -> list[Path]:
    """Roll a failed install back; returns the paths that could not be put back."""
    stuck = []
    for name, tmp in staged.items():
        if name not in done:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                stuck.append(tmp)
    for name in done:
        old = found[name]
        try:
            if old is None:
                (node / name).unlink()
            else:
                os.replace(_stage(node, name, old), node / name)
        except OSError:
            stuck.append(node / name)
    if made:
        try:
            os.rmdir(node)
        except OSError:
            stuck.append(node)
    return stuck


def uninstall(folder: str | Path) -> Outcome:
    """Remove what :func:`install` wrote; ``changed`` is False when there was nothing of ours.

    Removes each of the two files that starts with :data:`MARKER` — ours, perhaps an earlier version or one
    a user edited below that line — and their ``__pycache__/<module>.*.pyc``; then ``__pycache__`` and the
    node folder themselves, each only once empty. Everything else stays and is listed in
    :attr:`Outcome.left`. Refuses (nothing removed) a link or non-file in place of the folder or either file
    (:class:`UnsafeLayout`), and a folder whose files are all someone else's (:class:`ForeignFolder`).
    """
    node, exists = _node(folder, "uninstall")
    if not exists:
        return Outcome(node, False)
    found = _scan(node, "uninstall")
    ours = [name for name, data in found.items() if _ours(data)]
    if not ours:
        if any(data is not None for data in found.values()):
            theirs = ", ".join(name for name in FILES if found[name] is not None)
            raise ForeignFolder(f"{shown(node)} was not written by membackend ({theirs} without its marker line); "
                                f"it was left as it is")
        return Outcome(node, False, _left(node))
    removed: list[str] = []
    at = node
    try:
        for name in ours:
            at = node / name
            os.unlink(at)
            removed.append(name)
        cache = node / PYCACHE
        if cache.is_dir() and not cache.is_symlink():  # a link in its place is left alone
            modules = {Path(name).stem for name in ours}
            with os.scandir(cache) as entries:
                compiled = [Path(e.path) for e in entries if e.name.endswith(".pyc")
                            and e.name.partition(".")[0] in modules and e.is_file(follow_symlinks=False)]
            for at in compiled:
                os.unlink(at)
            at = cache
            if not os.listdir(cache):
                os.rmdir(cache)
        at = node
        if not os.listdir(node):
            os.rmdir(node)
    except OSError as exc:
        tail = f"removed before that: {', '.join(removed)}" if removed else "nothing was removed"
        raise _failed("remove", at, exc, tail) from None
    return Outcome(node, True, _left(node))


def _left(node: Path) -> tuple[str, ...]:
    if _lstat(node) is None:
        return ()
    with os.scandir(node) as entries:
        return tuple(sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries))
