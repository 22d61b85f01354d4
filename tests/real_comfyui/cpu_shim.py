"""Test-only: lift ComfyUI's explicit "is this the CPU" checks on its dynamic-VRAM path, and nothing else.

ComfyUI runs its dynamic path (a ``ModelPatcherDynamic`` whose weights live in a ``ModelVBAR``, faulted,
copied and cast layer by layer) only on a GPU. This machine has none, so the real-ComfyUI suite starts
ComfyUI with ``--cpu`` and lets membackend's simulated GPUs (which hold real bytes, read by torch as CPU
tensors) stand below it. What stands between ComfyUI's own code and that path are its explicit CPU
checks; this module rewrites exactly those lines of the tree's source as it is imported:

* ``comfy/model_patcher.py``, ``ModelPatcherDynamic.__new__``: the reroute of a CPU load device to a plain
  ``ModelPatcher``;
* ``comfy/model_patcher.py``, ``ModelPatcherDynamic._vbar_get``: ``return None`` for the CPU device;
* ``comfy/model_patcher.py``, ``ModelPatcherDynamic.partially_unload``: the assertion that the load device
  is not the CPU;
* ``comfy/ops.py``, ``cast_bias_weight``: the branch that copies a VBAR-backed layer's weights for a CPU
  device, and the test that sends a layer through the VBAR path only when its weights sit on another
  device than the compute device (on a GPU always true for such a layer: its weights stay on the offload
  device; with ``--cpu`` both are the CPU);
* ``comfy/memory_management.py``, ``read_tensor_file_slice_into``: the three tests of a destination's device type
  that decide whether a weight is read from its file to the device (``read_file_to_device``, or
  ``HostBuffer.read_file_slice`` with a device pointer): asked of membackend's session instead
  (:func:`on_device`: the simulated device's pages are CPU tensors), so the reads a GPU makes are made here too.

Each rewrite names the exact text it replaces. When the tree's text no longer matches (ComfyUI changed the
code), the import fails with :class:`ShimMismatch` naming the file, the check and the text it looked for,
so the test fails and says what changed rather than running a path nobody checked.

Installed by the harness's ``sitecustomize`` in the ComfyUI child when ``REAL_COMFYUI_CPU_SHIM`` names this
file; it also sets ``membackend._comfyui.startup.SERVE_CPU_DEVICES`` so that the ``host`` backend takes
over ComfyUI's (now CPU) dynamic path as a GPU backend would on a GPU. Never part of the product.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

#: (module, what is lifted, the exact text in the tree, what replaces it)
LIFTS: tuple[tuple[str, str, str, str], ...] = (
    ("comfy.model_patcher", "ModelPatcherDynamic.__new__: the CPU reroute to ModelPatcher",
     "        if load_device is not None and comfy.model_management.is_device_cpu(load_device):\n"
     "            #reroute to default MP for CPUs\n",
     "        if False:  # membackend test shim: the CPU reroute is lifted\n"
     "            #reroute to default MP for CPUs\n"),
    ("comfy.model_patcher", "ModelPatcherDynamic._vbar_get: no VBAR for the CPU",
     "    def _vbar_get(self, create=False):\n"
     "        if self.load_device == torch.device(\"cpu\"):\n"
     "            return None\n",
     "    def _vbar_get(self, create=False):\n"
     "        if False:  # membackend test shim: the CPU check is lifted\n"
     "            return None\n"),
    ("comfy.model_patcher", "ModelPatcherDynamic.partially_unload: the assertion against the CPU",
     "        assert not force_patch_weights #See above\n"
     "        assert self.load_device != torch.device(\"cpu\")\n",
     "        assert not force_patch_weights #See above\n"
     "        # membackend test shim: the assertion against the CPU is lifted\n"),
    ("comfy.ops", "cast_bias_weight: the CPU branch for a VBAR-backed layer",
     "    if hasattr(s, \"_v\") and comfy.model_management.is_device_cpu(device):\n",
     "    if False:  # membackend test shim: the CPU branch is lifted\n"),
    ("comfy.ops", "cast_bias_weight: the VBAR path only for weights on another device than the compute device",
     "    elif hasattr(s, \"_v\") and s.weight.device != device:\n",
     "    elif hasattr(s, \"_v\"):  # membackend test shim: with --cpu both devices are the CPU\n"),
    # comfy/memory_management.py, read_tensor_file_slice_into: a weight is read from its file into device memory
    # (comfy-aimdo's read_file_to_device, or HostBuffer.read_file_slice through a pin) only where the
    # destination's device type is not "cpu"; the simulated device's pages are CPU tensors, so its "is this the
    # device" is asked of membackend's session instead (on_device below)
    ("comfy.memory_management", "read_tensor_file_slice_into: the module that asks (the shim's on_device)",
     "import comfy_aimdo.host_buffer\n",
     "import comfy_aimdo.host_buffer\nimport membackend_cpu_shim  # membackend test shim: the device checks below\n"),
    ("comfy.memory_management", "read_tensor_file_slice_into: a lone device destination is read to the device",
     "    if destination is not None and destination.device.type != \"cpu\" and destination2 is None:\n",
     "    if destination is not None and membackend_cpu_shim.on_device(destination) and destination2 is None:\n"),
    ("comfy.memory_management", "read_tensor_file_slice_into: the host destination is not device memory",
     "            or (destination is not None and (destination.device.type != \"cpu\" or ",
     "            or (destination is not None and (membackend_cpu_shim.on_device(destination) or "),
    ("comfy.memory_management", "read_tensor_file_slice_into: the device destination is device memory",
     "            or (destination2 is not None and (destination2.device.type == \"cpu\" or ",
     "            or (destination2 is not None and (not membackend_cpu_shim.on_device(destination2) or "),
)


def on_device(tensor: Any) -> bool:
    """Whether ``tensor``'s bytes are the simulated device's -- inside a live reservation of membackend's session
    (a model's VBAR pages) or a block of one of its cast buffers (``VRAMBuffer``) -- which is what
    ``tensor.device.type != "cpu"`` tells on a GPU."""
    from membackend._comfyui.buffers import VRAMBuffer
    from membackend._comfyui.runtime import current

    rt = current()
    session = getattr(rt, "session", None)
    if session is None:
        return False
    ptr = tensor.data_ptr()
    return any(r.base <= ptr < r.base + r.size for r in session.reservations()) or VRAMBuffer.holding(ptr)


class ShimMismatch(ImportError):
    """The tree's code no longer has the text a lift replaces: the shim would run an unchecked path."""


def rewrite(module: str, source: str, origin: str = "?") -> str:
    """``source`` of ``module`` with every lift for it applied; :class:`ShimMismatch` when one does not fit."""
    for name, what, old, new in LIFTS:
        if name != module:
            continue
        found = source.count(old)
        if found != 1:
            raise ShimMismatch(
                f"membackend's CPU shim cannot lift '{what}' in {origin}: the text it replaces appears {found} "
                f"time(s), expected once; ComfyUI changed this code, so the shim must be brought up to date. "
                f"Looked for:\n{old}")
        source = source.replace(old, new)
    return source


class _Loader(importlib.machinery.SourceFileLoader):
    def get_data(self, path: str) -> bytes:  # the source, rewritten; never the cached bytecode
        if path.endswith(".py"):
            with open(path, encoding="utf-8") as f:
                return rewrite(self.name, f.read(), path).encode("utf-8")
        raise OSError("no cached bytecode for a shimmed module")

    def set_data(self, path: str, data: bytes, *, _mode: int = 0o666) -> None:
        """Never cache the rewritten module's bytecode: another process of the tree must read the real one."""


class _Finder(importlib.abc.MetaPathFinder):
    modules = {name for name, *_ in LIFTS}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return spec
        loader = _Loader(fullname, spec.origin)
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=loader,
                                                      submodule_search_locations=spec.submodule_search_locations)


def install() -> None:
    """Lift the checks in this process (before ComfyUI imports ``comfy``), and let the host backend take
    over the CPU device as a GPU backend would a GPU (membackend's own test switch); idempotent."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    from membackend._comfyui import startup

    startup.SERVE_CPU_DEVICES = True
