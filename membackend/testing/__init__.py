"""The conformance kit every backend must pass (a pytest plugin), its harness, and the fixtures it ships.

    pytest --pyargs membackend.testing.conformance --membackend-backend NAME
    pytest --pyargs membackend.testing.conformance --membackend-plugin package.module:MyBackend

Needs the ``kit`` extra (``pip install "/path/to/membackend[kit]"`` from a clone: pytest and hypothesis).

The property-based sequences (marker ``kit_long``) run from one seed per run:
``--membackend-seed N`` repeats a run, and a failed sequence prints the one
command that runs it again.

For a backend's, a platform's or membackend's own tests, the kit's plugin
registers these fixtures (none is autouse):

* ``membackend_clean_env`` — no ``MEMBACKEND_*`` variable in the environment
  and an empty temporary working directory, so no ``membackend.toml``,
  ``pyproject.toml`` or ``$MEMBACKEND_CONFIG`` reaches the settings. A
  ``conftest.py`` applies it to every test of its folder::

      @pytest.fixture(autouse=True)
      def _clean_env(membackend_clean_env):
          pass

* ``membackend_simulated`` — :func:`simulated_session`, each session it made
  closed after the test;
* ``membackend_seed`` — this run's seed of the property-based sequences.

and these functions:

* :func:`simulated_session` ``(profile, platform=None, *, backend=None,
  driver=None, capabilities=None, page_size=None, machine=None, observers=(),
  **settings)`` — the one builder of sessions on simulated machines: a
  session over a fresh simulation of a profile (``wddm-6gb``,
  ``rocm-win-2gpu``, ``gb10-128gb``, ``h200``, ...), on the generic VMM
  backend with the profile's knobs, a plugin's ``platform``, a variant
  ``driver`` or a ``backend`` built by the caller, with its own ledger;
  ``membackend.ResidencyManager(session)`` puts the residency policy on it;
* :func:`host_session` ``(*, capacity=None, headroom=None, page_size=None,
  observers=(), **settings)`` — a session on the host backend (this process's
  memory, nothing simulated), optionally capped;
* :func:`simulated_driver` ``(profile, vendor=None, *, hold_bytes=True,
  **changes)``, :func:`simulated_machine` ``(profile)``,
  :func:`simulated_profiles` ``(vmm_only=False)``, :func:`simulated_failures`
  ``()`` — a profile's driver (or a variant of it), its machine facts, the
  profile names, the exceptions that end a simulated machine;
* :class:`StockPolicy`, :class:`AimdoStockVmm`, :class:`AimdoLoadPolicy` —
  membackend's models of stock ComfyUI + comfy-aimdo 0.5.x, the stock side of a
  comparison;

  all of these from :mod:`membackend.testing.simulated`, which needs no pytest
  (benchmarks and a plugin's comparison code import it without the ``kit``
  extra);
* :func:`this_machine`, :func:`cuda_driver`, :func:`vmm_backend`,
  :func:`aimdo_backend`, :func:`event_token`, :func:`tensor_at` — what a check
  on a real GPU needs (:mod:`membackend.testing.real`, no pytest either);
* :func:`clean_environment` ``(monkeypatch, directory, also=())`` — what
  ``membackend_clean_env`` does, for a platform that also clears variables of
  its own;
* :func:`build_session`, :func:`checker_for`, :func:`driver_view`,
  :func:`inject_failures`, :func:`async_work`, :func:`parse_target` — the
  harness the kit's rules run on (see :mod:`membackend.testing.harness`).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees of the names below: the same objects, imported eagerly
    from .fixtures import clean_environment as clean_environment
    from .harness import Target as Target
    from .harness import async_work as async_work
    from .harness import build_session as build_session
    from .harness import checker_for as checker_for
    from .harness import driver_view as driver_view
    from .harness import inject_failures as inject_failures
    from .harness import parse_target as parse_target
    from .real import aimdo_backend as aimdo_backend
    from .real import cuda_driver as cuda_driver
    from .real import event_token as event_token
    from .real import tensor_at as tensor_at
    from .real import this_machine as this_machine
    from .real import vmm_backend as vmm_backend
    from .simulated import AimdoLoadPolicy as AimdoLoadPolicy
    from .simulated import AimdoStockVmm as AimdoStockVmm
    from .simulated import StockPolicy as StockPolicy
    from .simulated import host_session as host_session
    from .simulated import simulated_driver as simulated_driver
    from .simulated import simulated_failures as simulated_failures
    from .simulated import simulated_machine as simulated_machine
    from .simulated import simulated_profiles as simulated_profiles
    from .simulated import simulated_session as simulated_session

#: where each name lives (a name not listed: :mod:`membackend.testing.harness`): imported on first use, so
#: ``membackend doctor`` (which runs the kit's checks through the harness), the benchmarks and a plugin's
#: comparison code (which build sessions through :mod:`membackend.testing.simulated`) need no pytest, which
#: only the ``kit`` extra brings
_HOME = {
    "clean_environment": "fixtures",
    "simulated_session": "simulated", "host_session": "simulated", "simulated_driver": "simulated",
    "simulated_machine": "simulated", "simulated_profiles": "simulated", "simulated_failures": "simulated",
    "StockPolicy": "simulated", "AimdoStockVmm": "simulated", "AimdoLoadPolicy": "simulated",
    "this_machine": "real", "cuda_driver": "real", "vmm_backend": "real", "aimdo_backend": "real",
    "event_token": "real", "tensor_at": "real",
}

__all__ = ["Target", "async_work", "build_session", "checker_for", "driver_view", "inject_failures", "parse_target",
           "clean_environment", "simulated_session", "host_session", "simulated_driver", "simulated_machine",
           "simulated_profiles", "simulated_failures", "StockPolicy", "AimdoStockVmm", "AimdoLoadPolicy",
           "this_machine", "cuda_driver", "vmm_backend", "aimdo_backend", "event_token", "tensor_at"]


if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name is an error there and not Any

    def __getattr__(name: str) -> Any:
        if name not in __all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = getattr(import_module(f"{__name__}.{_HOME.get(name, 'harness')}"), name)
        globals()[name] = value
        return value
