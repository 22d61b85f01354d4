"""Shared fixtures: isolated settings (no stray MEMBACKEND_* env or config files) and a host session."""

from __future__ import annotations

import os

import pytest

from membackend._backends.host import HostBackend
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._session import Session


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """Every test starts with no MEMBACKEND_* variables, in an empty directory."""
    for key in list(os.environ):
        if key.startswith("MEMBACKEND_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


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
