"""The conformance kit every backend must pass (a pytest plugin), its harness, and the fixtures it ships.

    pytest --pyargs membackend.testing.conformance --membackend-backend NAME
    pytest --pyargs membackend.testing.conformance --membackend-plugin package.module:MyBackend

Needs the ``kit`` extra (``pip install membackend[kit]``: pytest and hypothesis).

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

* :func:`simulated_session` ``(profile, platform=None, *, capabilities=None,
  observers=(), **settings)`` — a session on ``VmmBackend(platform, driver)``
  over a fresh simulation of a profile (``wddm-6gb``, ``rocm-win-2gpu``,
  ``gb10-128gb``, ``h200``), with its own ledger; ``ResidencyManager(session)``
  puts the residency policy on it;
* :func:`clean_environment` ``(monkeypatch, directory, also=())`` — what
  ``membackend_clean_env`` does, for a platform that also clears variables of
  its own;
* :func:`build_session`, :func:`checker_for`, :func:`driver_view`,
  :func:`inject_failures`, :func:`async_work`, :func:`parse_target` — the
  harness the kit's rules run on (see :mod:`membackend.testing.harness`).
"""

from typing import Any

__all__ = ["Target", "async_work", "build_session", "checker_for", "clean_environment", "driver_view",
           "inject_failures", "parse_target", "simulated_session"]

#: where each name lives: imported on first use, so ``membackend doctor`` (which runs the kit's checks
#: through :mod:`membackend.testing.harness`) needs no pytest, which only the ``kit`` extra brings
_HOME = {"clean_environment": "fixtures", "simulated_session": "fixtures"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{_HOME.get(name, 'harness')}"), name)
    globals()[name] = value
    return value
