"""Every public name of comfy-aimdo 0.4.13, 0.5.5 and 0.6.0, and its one answer while membackend serves.

Nothing imports this module at ComfyUI's start-up: it is the account the tests
(``tests/test_comfyui_aimdo_names.py``, which reads the names from each installed release's wheel, and
``tests/test_comfyui_aimdo_calls.py``, which reads the calls of a ComfyUI tree) and the documentation
(``docs/comfyui.md``) are checked against. A name is ``comfy_aimdo.<module>.<name>``; a class member is
``comfy_aimdo.<module>.<Class>.<member>`` and a constructor parameter
``comfy_aimdo.<module>.<Class>.__init__(<parameter>)``. Each has exactly one :class:`Answer`:

* **served** -- membackend answers the call itself while it serves (:func:`membackend._comfyui.wiring.served`:
  the facade, the buffers, the ``init_devices`` seam, the log levels, and :mod:`.aimdo_newer`); a member of a
  served class is served by the same member of membackend's class, a constructor parameter by its
  constructor's parameter of that name -- a member or parameter membackend's class lacks has no answer;
* **left to comfy-aimdo** -- with the reason no call of it reaches aimdo's native code for a device
  membackend serves, or why it is harmless (:data:`membackend._comfyui.wiring.LEFT_TO_AIMDO`);
* **kept out** -- ComfyUI calls it only while one of its own switches is off, and membackend turns that
  switch on when it starts (:data:`KEPT_OUT`, :data:`SWITCHES`).

Members and constructor parameters of a class that is left or kept out share the class's answer.

The names new since 0.4.13 (ComfyUI 0.35 moved from comfy-aimdo 0.4.15 to 0.5.3; the newest ComfyUI
requirements read pin 0.5.5):

* ``control.record`` (0.5.0), ``malloc_graph.record`` and ``malloc_graph.MallocGraph`` with its members:
  kept out by ``--disable-comfy-compiler`` (ComfyUI's model compiler);
* ``control.set_simple_vram_headroom``, ``control.get_simple_vram_headroom`` (0.5.3): served, the session's
  live headroom on every served device (:mod:`.aimdo_newer`);
* ``storage.fast_disk``, ``storage.lib`` (0.5.4): left, a Windows disk query touching no GPU;
* ``model_vbar.ModelVBAR.__init__(pageout_callback)``, ``model_vbar.ModelVBAR.close`` (0.6.0): served by
  membackend's ``ModelVBAR`` (it takes the callback; ``close`` returns the reservation);
* ``model_vbar.PageoutCallback`` (0.6.0): left, a ctypes type with no call of its own;
* ``host_buffer.write_device_to_file``, ``host_buffer.write_host_to_file`` (0.6.0): served
  (:mod:`.aimdo_newer`).

ComfyUI's use of them, as read (each file at its own commit of Comfy-Org/ComfyUI; the 0.33.0 tree in
``shared/comfyui`` calls none of them): ``comfy/model_prefetch.py`` @03fb330a7f50 builds a ``MallocGraph``
with ``comfy_aimdo.malloc_graph.record(stream, args.assert_graph_breaks)`` in ``malloc_graph_begin`` only when
``malloc_graph_enabled(device)``, i.e. ``not args.disable_comfy_compiler and aimdo_enabled and
is_device_cuda(device)``; every other ``MallocGraph`` call goes through ``MALLOC_GRAPHS``, empty then.
``comfy/storage.py`` @2d656ace126d imports ``comfy_aimdo.storage.fast_disk`` in ``fast_storage`` on Windows
only. ``main.py`` @02018c7eb588 calls none of them; ``comfy/model_patcher.py`` @08d0e510f4e5
(``ModelPatcherDynamic``) builds ``ModelVBAR(size, index)`` with no callback and lets the VBAR go with its
``__del__``, never ``close``. ``set/get_simple_vram_headroom`` are called by custom nodes (read, raise,
restore); ``close``, ``pageout_callback`` and ``write_*_to_file`` by no ComfyUI source read: they are
answered for the release that will.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import wiring

__all__ = ["Answer", "SERVED", "LEFT", "KEPT", "KEPT_OUT", "SWITCHES", "NOT_IN_ANY_RELEASE", "table", "answer",
           "unanswered", "module_level", "qualified"]

SERVED = "served"
LEFT = "left to comfy-aimdo"
KEPT = "kept out by ComfyUI's switch"

#: ComfyUI flag (as typed) -> (its attribute on ``comfy.cli_args.args``, where membackend turns it on)
SWITCHES = {
    "--disable-comfy-compiler": ("disable_comfy_compiler", "membackend._comfyui.runtime.Runtime.start"),
}

_COMPILER = ("ComfyUI's model compiler is its only caller: comfy/model_prefetch.py malloc_graph_begin() calls "
             "comfy_aimdo.malloc_graph.record only when malloc_graph_enabled(device), which is False under "
             "--disable-comfy-compiler; aimdo's record would look up aimdo's device context for the stream's "
             "device (none there for a served device) and record its allocations natively")

#: name -> (the ComfyUI flag that keeps every call of it out, why)
KEPT_OUT = {
    "comfy_aimdo.control.record": ("--disable-comfy-compiler",
                                   "the same as malloc_graph.record, which it calls. " + _COMPILER),
    "comfy_aimdo.malloc_graph.record": ("--disable-comfy-compiler", _COMPILER),
    "comfy_aimdo.malloc_graph.MallocGraph": ("--disable-comfy-compiler",
                                             "made only by record; ComfyUI keeps one per thread in "
                                             "comfy.model_prefetch.MALLOC_GRAPHS, which stays empty under the "
                                             "switch, so none of its methods (push, pop, abort, pause, resume, "
                                             "use_stream, iterate, the statistics) ever runs"),
}

#: names a ComfyUI calls that no comfy-aimdo release has (ComfyUI catches the AttributeError): answered in the
#: table although no release holds them; a test fails the day one does, so the answer gets looked at again
NOT_IN_ANY_RELEASE = frozenset({"comfy_aimdo.control.set_log_detail"})


@dataclass(frozen=True)
class Answer:
    """The one answer for one comfy-aimdo name: ``kind`` is :data:`SERVED`, :data:`LEFT` or :data:`KEPT`;
    ``why`` says it in words; ``by`` is membackend's object (served), ``flag`` ComfyUI's switch (kept out)."""

    name: str
    kind: str
    why: str
    by: Any = None
    flag: str | None = None


def qualified(obj: Any) -> str:
    """``module.qualname`` of a membackend object (for the words of a served answer)."""
    fn = getattr(obj, "__func__", obj)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def table() -> dict[str, Answer]:
    """The table: every module-level name (``comfy_aimdo.<module>.<name>``) with its one answer. A name given
    two answers (served and left, or left and kept out, ...) raises ``ValueError`` naming it."""
    served = wiring.served()
    sources = (("served()", served), ("LEFT_TO_AIMDO", wiring.LEFT_TO_AIMDO), ("KEPT_OUT", KEPT_OUT))
    seen: dict[str, str] = {}
    twice = []
    for where, names in sources:
        for name in names:
            if name in seen:
                twice.append(f"{name} ({seen[name]} and {where})")
            seen[name] = where
    if twice:
        raise ValueError(f"comfy-aimdo names with more than one answer: {', '.join(sorted(twice))}")
    out = {name: Answer(name, SERVED, f"served by {qualified(by)}", by=by) for name, by in served.items()}
    out.update({name: Answer(name, LEFT, why) for name, why in wiring.LEFT_TO_AIMDO.items()})
    for name, (flag, why) in KEPT_OUT.items():
        attr, where = SWITCHES[flag]
        out[name] = Answer(name, KEPT, f"kept out by ComfyUI's {flag}, which {where} turns on (args.{attr} = True "
                                       f"where ComfyUI has it, before any model runs): {why}", flag=flag)
    return dict(sorted(out.items()))


def module_level(name: str) -> tuple[str, str | None, str | None]:
    """``(comfy_aimdo.<module>.<name>, member or None, constructor parameter or None)`` of any public name."""
    parts = name.split(".")
    top = ".".join(parts[:3])
    rest = ".".join(parts[3:])
    if not rest:
        return top, None, None
    if rest.startswith("__init__(") and rest.endswith(")"):
        return top, None, rest[len("__init__("):-1]
    return top, rest, None


def _takes(fn: Any, parameter: str) -> bool:
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == parameter or p.kind is inspect.Parameter.VAR_KEYWORD for p in ps)


def answer(name: str, rows: dict[str, Answer] | None = None) -> Answer | None:
    """The answer for any public name (module level, class member, constructor parameter); None: none."""
    rows = table() if rows is None else rows
    top, member, parameter = module_level(name)
    row = rows.get(top)
    if row is None or (member is None and parameter is None):
        return row
    label = member if member is not None else f"__init__({parameter})"
    if row.kind != SERVED:
        return Answer(name, row.kind, f"{label} of {top}, whose answer it shares: {row.why}", flag=row.flag)
    ours = row.by
    if not inspect.isclass(ours):
        return None
    if member is not None:
        if not hasattr(ours, member):
            return None
        by = getattr(ours, member)
        return Answer(name, SERVED, f"served by {qualified(ours)}.{member}", by=by)
    assert parameter is not None  # the name has a member or a parameter, and no member
    init = ours.__init__
    if not _takes(init, parameter):
        return None
    return Answer(name, SERVED, f"served by {qualified(ours)}.__init__, which takes {parameter}", by=init)


def unanswered(names: Iterable[str], rows: dict[str, Answer] | None = None) -> list[str]:
    """The names among ``names`` without an answer."""
    rows = table() if rows is None else rows
    return [n for n in names if answer(n, rows) is None]
