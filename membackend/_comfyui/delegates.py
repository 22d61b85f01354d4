"""Hook delegates go with their owner's unload (G5).

A dynamic patcher with Hook LoRAs makes a non-dynamic delegate model (``non_dynamic_delegate_model``) and
caches it on itself. Stock ComfyUI never lets go of that cache, so the delegate's weights stayed on the device
after its owner was unloaded (20.96 GiB held, the next VAE load out of memory). :class:`HookDelegates`
remembers each delegate by its ``nn.Module``; when the delegate or its owner is unloaded, the owner lets go of
it. Nothing here keeps a delegate or an owner alive.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .lines import gb, say

__all__ = ["HookDelegates"]


class HookDelegates:
    """The Hook delegates ComfyUI made, by their nn.Module, weakly; safe to share between ComfyUI's threads."""

    def __init__(self) -> None:
        #: id of a Hook delegate's nn.Module -> (weak reference to its dynamic owner, the delegate's bytes)
        self._owners: dict[int, tuple[weakref.ReferenceType[Any], int]] = {}
        #: every Hook delegate's nn.Module while anything keeps it alive (the status counts them)
        self._modules: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def track(self, owner: Any, delegate: Any) -> None:
        """ComfyUI made (or reused) ``owner``'s non-dynamic Hook delegate: remember it by the delegate's
        nn.Module, with its weights' bytes, so that its unload drops the owner's cached copy."""
        module = getattr(delegate, "model", None)
        if module is None:
            return
        try:
            size = int(delegate.model_size())
        except Exception:  # noqa: BLE001 - the size is for the status only
            size = 0
        with self._lock:
            self._owners[id(module)] = (weakref.ref(owner), size)
            self._modules.add(module)

    def drop(self, patcher: Any) -> bool:
        """``patcher`` (a delegate or its owner) was unloaded: the owner lets go of its cached delegate, with
        one line. Returns whether a delegate was let go of."""
        module = getattr(patcher, "model", None)
        with self._lock:
            found = [k for k, (ref, _) in self._owners.items() if k == id(module) or ref() is patcher]
            entries = [self._owners.pop(k) for k in found]
        dropped = False
        for ref, size in entries:
            owner = ref()
            if owner is not None and getattr(owner, "non_dynamic_delegate_model", None) is not None:
                owner.non_dynamic_delegate_model = None
                dropped = True
                say(f"the Hook delegate of {type(getattr(owner, 'model', owner)).__name__} ({gb(size)}) goes "
                    "with its unload")
        return dropped

    def held(self) -> list[dict[str, Any]]:
        """The Hook delegates still cached by their owner: the owner's model class and the delegate's bytes."""
        with self._lock:
            entries = list(self._owners.values())
        out = []
        for ref, size in entries:
            owner = ref()
            if owner is not None and getattr(owner, "non_dynamic_delegate_model", None) is not None:
                out.append({"owner": type(getattr(owner, "model", owner)).__name__, "bytes": size})
        return out

    def alive(self) -> int:
        """How many Hook delegates' nn.Modules anything still keeps alive."""
        return len(list(self._modules))
