"""``membackend._lazy.lazy_attributes``: a package's names imported on first use from their submodules, once, and
any other name an ``AttributeError`` as a module gives; the lab's and the kit's packages use it."""

from __future__ import annotations

import sys
import types

import pytest

import membackend.lab
import membackend.testing
from membackend._lazy import lazy_attributes


def test_a_name_is_imported_on_first_use_and_kept():
    namespace: dict = {}
    lookup = lazy_attributes("membackend.lab", {"simulated_session": ".simulated"}, namespace)
    value = lookup("simulated_session")
    assert value is sys.modules["membackend.lab.simulated"].simulated_session
    assert namespace == {"simulated_session": value}  # kept: the next lookup is the package's own global


def test_another_name_is_an_attribute_error_naming_the_package():
    lookup = lazy_attributes("membackend.lab", {"simulated_session": ".simulated"}, {})
    with pytest.raises(AttributeError, match="module 'membackend.lab' has no attribute 'simulated_sesion'"):
        lookup("simulated_sesion")


def test_a_home_that_lacks_the_name_is_an_attribute_error_too():
    module = types.ModuleType("membackend._lazy_probe_home")
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(AttributeError):
            lazy_attributes("membackend", {"gone": "._lazy_probe_home"}, {})("gone")
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("package", [membackend.lab, membackend.testing])
def test_the_packages_answer_their_names_and_refuse_others(package):
    assert all(getattr(package, name) is not None for name in package.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        package.nothing_here  # noqa: B018
