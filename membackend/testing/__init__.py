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

* ``membackend_simulated`` — :func:`membackend.lab.simulated_session`, each
  session it made closed after the test;
* ``membackend_seed`` — this run's seed of the property-based sequences.

and these functions:

* :func:`clean_environment` ``(monkeypatch, directory, also=())`` — what
  ``membackend_clean_env`` does, for a platform that also clears variables of
  its own;
* :func:`build_session`, :func:`checker_for`, :func:`driver_view`,
  :func:`inject_failures`, :func:`async_work`, :func:`parse_target` — the
  harness the kit's rules run on (see :mod:`membackend.testing.harness`).

The builders of sessions on simulated machines, the stock comfy-aimdo models
and the pieces of a check on a real GPU are tooling, in :mod:`membackend.lab`
(``membackend.lab.simulated_session``, ``membackend.lab.vmm_backend``, ...).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # what a type checker sees of the names below: the same objects, imported eagerly
    from .fixtures import clean_environment as clean_environment
    from .harness import Target as Target
    from .harness import async_work as async_work
    from .harness import build_session as build_session
    from .harness import checker_for as checker_for
    from .harness import driver_view as driver_view
    from .harness import inject_failures as inject_failures
    from .harness import parse_target as parse_target

#: where each name lives (a name not listed: :mod:`membackend.testing.harness`): imported on first use, so
#: ``membackend doctor`` (which runs the kit's checks through the harness) needs no pytest, which only the
#: ``kit`` extra brings
_HOME = {"clean_environment": "fixtures"}

__all__ = ["Target", "async_work", "build_session", "checker_for", "driver_view", "inject_failures", "parse_target",
           "clean_environment"]

if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name is an error there and not Any
    __getattr__ = lazy_attributes(__name__, {name: f".{_HOME.get(name, 'harness')}" for name in __all__}, globals())
