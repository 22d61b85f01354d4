"""Shared fixtures: isolated settings for every test (the kit's ``membackend_clean_env``: no stray
MEMBACKEND_* variable or config file, an empty working directory) and host sessions."""

from __future__ import annotations

import pytest

from membackend._backends.host import HostBackend
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._session import Session


@pytest.fixture(autouse=True)
def _clean_env(membackend_clean_env):
    """Every test starts with no MEMBACKEND_* variables, in an empty directory."""


@pytest.fixture
def host_session():
    backend = HostBackend(page_size=2 << 20)
    session = Session(backend, machine=gather_machine(), ledger=Ledger())
    yield session
    session.close()


@pytest.fixture
def sanitized_session():
    backend = HostBackend(page_size=2 << 20)
    session = Session(backend, machine=gather_machine(), ledger=Ledger(sanitize=True))
    yield session
    session.close()
