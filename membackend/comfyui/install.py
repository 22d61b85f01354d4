"""``membackend comfyui install|uninstall <ComfyUI folder>``: the custom node that starts membackend.

``install`` writes ``custom_nodes/membackend/`` with two small files:

* ``prestartup_script.py`` — ComfyUI runs it before importing torch; it calls
  :func:`membackend.comfyui.startup.prestartup`, which selects the backend and
  logs one line;
* ``__init__.py`` — loaded with the custom nodes; it registers the
  ``GET /membackend/status`` route when ComfyUI's server exists.

Both files only import membackend inside ``try``: a missing or broken
membackend leaves ComfyUI starting stock. Both commands are idempotent;
both refuse (:class:`NotComfyUI`, exit 2) a folder that is not a ComfyUI
checkout, and ``uninstall`` refuses to delete a ``custom_nodes/membackend``
that this command did not write (:class:`ForeignFolder`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..types import MembackendError

__all__ = ["NotComfyUI", "ForeignFolder", "install", "uninstall", "is_comfyui", "NODE_DIR", "MARKER"]

NODE_DIR = "membackend"
MARKER = "# membackend custom node: written by `membackend comfyui install`"
REQUIRED = ("main.py", "comfy/model_management.py", "custom_nodes")


class NotComfyUI(MembackendError, ValueError):
    """The folder given is not a ComfyUI checkout; nothing was written or removed."""


class ForeignFolder(MembackendError, ValueError):
    """``custom_nodes/membackend`` exists but was not written by ``membackend comfyui install``."""


PRESTARTUP = f'''{MARKER}
# ComfyUI runs this before it imports torch. membackend must never stop ComfyUI from starting:
# whatever goes wrong here is logged in one line and ComfyUI carries on stock.
try:
    from membackend.comfyui.startup import prestartup as _membackend_prestartup

    _membackend_prestartup()
except Exception as _exc:  # noqa: BLE001
    import logging as _logging

    _logging.getLogger("membackend").warning(
        "membackend: not started (%s: %s); ComfyUI runs stock", type(_exc).__name__, _exc)
'''

INIT = f'''{MARKER}
# Loaded with the custom nodes; no nodes of its own. Registers GET /membackend/status.
NODE_CLASS_MAPPINGS = {{}}
NODE_DISPLAY_NAME_MAPPINGS = {{}}
try:
    from membackend.comfyui.status import register_routes as _membackend_routes

    _membackend_routes()
except Exception as _exc:  # noqa: BLE001
    import logging as _logging

    _logging.getLogger("membackend").warning(
        "membackend: status route not registered (%s: %s)", type(_exc).__name__, _exc)
'''

FILES = {"prestartup_script.py": PRESTARTUP, "__init__.py": INIT}


def is_comfyui(folder: Path) -> list[str]:
    """What ``folder`` lacks to be a ComfyUI checkout (empty: it is one)."""
    return [name for name in REQUIRED if not (folder / name).exists()]


def _check(folder: str | Path) -> Path:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise NotComfyUI(f"{path} is not a folder; accepted: the folder of a ComfyUI checkout "
                         f"(it holds {', '.join(REQUIRED)})")
    missing = is_comfyui(path)
    if missing:
        raise NotComfyUI(f"{path} is not a ComfyUI checkout: no {', '.join(missing)}; accepted: the folder "
                         f"that holds {', '.join(REQUIRED)} (for the portable build, its ComfyUI subfolder)")
    return path


def _ours(node: Path) -> bool:
    init = node / "__init__.py"
    try:
        return init.read_text(encoding="utf-8").startswith(MARKER)
    except OSError:
        return False


def install(folder: str | Path) -> tuple[Path, bool]:
    """Write the custom node; returns ``(its folder, whether anything changed)``."""
    node = _check(folder) / "custom_nodes" / NODE_DIR
    if node.exists() and not _ours(node):
        raise ForeignFolder(f"{node} exists and was not written by membackend; move it away, then install again")
    node.mkdir(exist_ok=True)
    changed = False
    for name, text in FILES.items():
        target = node / name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            changed = True
    return node, changed


def uninstall(folder: str | Path) -> tuple[Path, bool]:
    """Remove the custom node; returns ``(its folder, whether anything was removed)``."""
    node = _check(folder) / "custom_nodes" / NODE_DIR
    if not node.exists():
        return node, False
    if not _ours(node):
        raise ForeignFolder(f"{node} was not written by membackend; it was left as it is")
    shutil.rmtree(node)
    return node, True
