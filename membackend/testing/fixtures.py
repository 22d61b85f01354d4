"""Fixtures and builders the kit ships for the tests of backends, platforms and membackend itself.

The kit's pytest plugin registers the fixtures (nothing is autouse: loaded in
any pytest run, they change nothing until a test or a conftest asks for them):

* ``membackend_clean_env``: the test runs with no ``MEMBACKEND_*`` variable in
  the environment and an empty temporary directory as its working directory,
  so no ``membackend.toml``, ``pyproject.toml`` or ``$MEMBACKEND_CONFIG`` of the
  developer's reaches the settings. Make it apply to every test of a folder
  from its ``conftest.py``::

      @pytest.fixture(autouse=True)
      def _clean_env(membackend_clean_env):
          pass

  A platform that reads variables of its own beyond ``MEMBACKEND_*`` clears
  those in the same fixture (``monkeypatch.delenv(name, raising=False)``), or
  calls :func:`clean_environment` with ``also=(...)``.
* ``membackend_simulated``: :func:`simulated_session` that closes, after the
  test, every session it made.

The builder the second fixture wraps, :func:`~membackend.lab.simulated_session`,
is the lab's (:mod:`membackend.lab.simulated`, which needs no pytest, so
benchmarks use it too).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pytest

from .._session import Session
from ..lab.simulated import simulated_session
from ..platform import Platform

__all__ = ["ENV_PREFIX", "clean_environment", "membackend_clean_env", "membackend_simulated"]

#: every variable membackend and its platform plugins read starts with this
ENV_PREFIX = "MEMBACKEND_"


def clean_environment(monkeypatch: pytest.MonkeyPatch, directory: str | os.PathLike[str],
                      also: Iterable[str] = ()) -> None:
    """Remove every ``MEMBACKEND_*`` variable (and each name in ``also``) from the environment and make
    ``directory`` the working directory, both through ``monkeypatch`` (undone after the test)."""
    extra = set(also)
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX) or key in extra:
            monkeypatch.delenv(key)
    monkeypatch.chdir(Path(directory))


@pytest.fixture
def membackend_clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ``MEMBACKEND_*`` variable, and the test's empty ``tmp_path`` as the working directory (returned)."""
    clean_environment(monkeypatch, tmp_path)
    return tmp_path


@pytest.fixture
def membackend_simulated() -> Iterator[Callable[..., Session]]:
    """:func:`~membackend.lab.simulated_session`, every session it made closed after the test."""
    made: list[Session] = []

    def make(profile: str, platform: Platform | None = None, **kwargs: Any) -> Session:
        session = simulated_session(profile, platform, **kwargs)
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()
