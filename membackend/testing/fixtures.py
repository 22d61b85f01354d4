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

And the builder, for tests and benchmarks alike:

* :func:`simulated_session` — a :class:`~membackend._session.Session` on the
  generic VMM mechanism (``VmmBackend(platform, driver)``) over a fresh
  simulation of one profile, with its own :class:`~membackend._ledger.Ledger`;
  put a ``ResidencyManager(session)`` on it for the policy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pytest

from .._backends.vmm import VmmBackend
from .._drivers.open import machine_for, open_gpu_driver, resolve_vendor
from .._ledger import Ledger
from .._session import Session
from .._settings import load_settings
from ..platform import GENERIC, Platform
from ..types import Capabilities, ConfigError

__all__ = ["ENV_PREFIX", "clean_environment", "simulated_session", "membackend_clean_env", "membackend_simulated"]

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


def simulated_session(profile: str, platform: Platform | None = None, *, capabilities: Capabilities | None = None,
                      observers: Iterable[Any] = (), **settings: Any) -> Session:
    """A session on ``VmmBackend(platform, driver)`` over a fresh simulation of ``profile``.

    * ``platform``: a :class:`~membackend.platform.Platform` (a plugin's
      record), used exactly as that plugin uses it: its vendor, page size and
      capabilities. None: the generic platform tuned with the profile's own
      knobs (the profile's ``capabilities()``: unified pool, address quota, reserve-churn
      limit, fence granularity, page-in synchronisation of the profile's OS),
      which is what a platform plugin for that machine would declare.
    * ``capabilities`` replaces the platform's (or the profile's) knobs.
    * ``settings``: keywords of :func:`~membackend._settings.load_settings`
      applied with ``sim_profile=profile``: ``sanitize`` (the ledger's sanitize
      mode), ``page_size`` and ``headroom`` (replacing the platform's),
      ``trace`` (a trace file), ``machine`` (overrides of the discovered facts).
    * ``observers``: pluggy observers around the verbs.

    The machine is the profile's, discovered through its simulated driver; the
    driver itself is a fresh simulation reached as ``session.backend.driver``
    (its ``sim`` is the simulated platform, to inspect or inject faults). Every
    call makes a new simulation, so sessions never share state. The caller
    closes the session (the ``membackend_simulated`` fixture does it).

    Raises ``ConfigError`` for an unknown profile (naming the known ones), a
    platform whose vendor is not the profile's, a setting that cannot be used,
    or a ``platform`` that is no ``Platform``.
    """
    if platform is not None and not isinstance(platform, Platform):
        raise ConfigError("platform", "simulated_session", f"{platform!r} is not a Platform",
                          "a membackend.platform.Platform (a plugin's record), or None for the generic platform")
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise ConfigError("capabilities", "simulated_session", f"{capabilities!r} is not a Capabilities",
                          "a membackend.types.Capabilities, or None for the platform's (or the profile's) own")
    chosen = platform or GENERIC
    s = load_settings(sim_profile=profile, **settings)
    machine = machine_for(s)  # validates the profile first
    driver = open_gpu_driver(resolve_vendor(chosen.vendor, s), profile)
    if capabilities is None and platform is None:
        capabilities = driver.sim.profile.capabilities()
    # the platform's own page size unless one is asked for, and its declared settings, as the plugin runs;
    # the session applies the headroom
    backend = VmmBackend(chosen, driver, capabilities=capabilities, machine=lambda: machine,
                         page_size=s.page_size if "page_size" in settings else None,
                         platform_values=chosen.setting_values(s))
    watchers = list(observers)
    tracer = None
    if s.trace is not None:
        from .._trace import TraceObserver

        tracer = TraceObserver(s.trace, backend=backend.name, sim_profile=profile,
                               devices=[{"device": str(d.device), "name": d.name, "total_memory": d.total_memory}
                                        for d in machine.devices])
        watchers.append(tracer)
    return Session(backend, machine=machine, ledger=Ledger(sanitize=s.sanitize), observers=watchers,
                   headroom=s.headroom, tracer=tracer)


@pytest.fixture
def membackend_clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ``MEMBACKEND_*`` variable, and the test's empty ``tmp_path`` as the working directory (returned)."""
    clean_environment(monkeypatch, tmp_path)
    return tmp_path


@pytest.fixture
def membackend_simulated() -> Iterator[Callable[..., Session]]:
    """:func:`simulated_session`, every session it made closed after the test."""
    made: list[Session] = []

    def make(profile: str, platform: Platform | None = None, **kwargs: Any) -> Session:
        session = simulated_session(profile, platform, **kwargs)
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()
