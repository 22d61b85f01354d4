"""The whole backend contract is ``membackend/hookspec.py``: the hook specifications (each with an example),
the ``Backend`` and ``OptionalHooks`` protocols that mirror them exactly, and an ``__all__``."""

from __future__ import annotations

import inspect

import pytest

from membackend import hookspec
from membackend._backends.aimdo import AimdoBackend
from membackend._backends.host import HostBackend
from membackend._backends.vmm import VmmBackend
from membackend.hookspec import HOOKS, OPTIONAL_HOOKS, Backend, OptionalHooks


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("protocol, names", [(Backend, HOOKS), (OptionalHooks, OPTIONAL_HOOKS)])
def test_each_protocol_mirrors_its_hook_specifications(protocol, names):
    methods = {n for n, v in vars(protocol).items() if n.startswith("membackend_") and callable(v)}
    assert methods == set(names)
    for name in names:
        spec, method = getattr(hookspec, name), getattr(protocol, name)
        assert _params(method) == _params(spec), name  # pluggy passes the arguments by these names
        assert inspect.signature(method).return_annotation == inspect.signature(spec).return_annotation, name


def test_every_hook_is_specified_documented_with_an_example_and_exported():
    for name in HOOKS + OPTIONAL_HOOKS:
        doc = inspect.getdoc(getattr(hookspec, name)) or ""
        assert "Example::" in doc and f"def {name}(self" in doc, name
        assert name in hookspec.__all__
    assert set(OPTIONAL_HOOKS) == {"membackend_trim", "membackend_inspect", "membackend_inject_failures",
                                   "membackend_close"}
    for name in hookspec.__all__:
        assert hasattr(hookspec, name), name
    for name in OPTIONAL_HOOKS:  # the module docstring lists every optional hook
        assert name in (hookspec.__doc__ or "")


def test_the_built_in_backends_satisfy_the_protocol():
    from membackend._drivers.open import LazyDriver
    from membackend.platform import GENERIC

    vmm = VmmBackend(GENERIC, driver_factory=LazyDriver("cuda", "h200"))
    for backend in (HostBackend(), vmm, AimdoBackend()):
        assert isinstance(backend, Backend), type(backend).__name__
    assert isinstance(vmm, OptionalHooks)  # all four; the host backend has some of them only
    assert not isinstance(HostBackend(), OptionalHooks)


def test_the_protocol_check_can_fail():
    class NoFree:
        name = "nofree"
        device_kinds = ("cpu",)

        def membackend_probe(self, machine): ...
        def membackend_reserve(self, device, size): ...
        def membackend_fault(self, reservation, offset, size): ...
        def membackend_release_reservation(self, reservation): ...
        def membackend_fence(self, device, reservation): ...
        def membackend_budget_query(self, device): ...

    assert not isinstance(NoFree(), Backend)
