"""The conformance kit's pytest plugin (entry point ``pytest11``).

Options:

* ``--membackend-backend NAME`` (repeatable): the targets to check; ``NAME:PROFILE``
  runs a simulated-driver backend on one profile;
* ``--membackend-profile NAME`` (repeatable, or ``all``): profiles for targets given
  without one whose backend runs over a simulated driver (``honours_sim_profile``);
* ``--membackend-examples N``: property-based sequences per target (default 25).

Without options, the ini value ``membackend_targets`` (a line list) is used,
else ``host``. The plugin only adds fixtures and options: loaded in any pytest
run, it changes nothing until a test asks for ``membackend_session``.
"""

from __future__ import annotations

import sys

import pytest

from .harness import build_session, parse_target, runs_on_simulations

SUMMARY_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("membackend", "membackend conformance kit")
    group.addoption("--membackend-backend", action="append", default=[], metavar="NAME[:PROFILE]",
                    help="backend to run the conformance kit against (repeatable)")
    group.addoption("--membackend-profile", action="append", default=[], metavar="PROFILE",
                    help="simulated profile for targets given without one (repeatable; 'all')")
    group.addoption("--membackend-examples", type=int, default=None, metavar="N",
                    help="property-based sequences per target (default 25)")
    parser.addini("membackend_targets", "default targets of the conformance kit", type="linelist", default=[])
    parser.addini("membackend_examples", "property-based sequences per target", default="25")


def _targets(config: pytest.Config) -> list:
    names = config.getoption("membackend_backend") or config.getini("membackend_targets") or ["host"]
    profiles = config.getoption("membackend_profile")
    return [t for name in names
            for t in parse_target(name, profiles, simulated=bool(profiles) and runs_on_simulations(name.split(":")[0]))]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "membackend_target" in metafunc.fixturenames:
        targets = _targets(metafunc.config)
        metafunc.parametrize("membackend_target", targets, ids=[str(t) for t in targets])


@pytest.fixture
def membackend_examples(request: pytest.FixtureRequest) -> int:
    return request.config.getoption("membackend_examples") or int(request.config.getini("membackend_examples"))


@pytest.fixture
def membackend_session(membackend_target):
    """A fresh session forced onto the target; afterwards everything is released and checked for leaks."""
    from .conformance import _check_nothing_left

    session = build_session(membackend_target)
    yield session
    session.close()
    for device in session.devices()[:1]:
        _check_nothing_left(session, device)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    # only when the kit ran: importing it needs hypothesis, which a plain install lacks
    kit = sys.modules.get("membackend.testing.conformance")
    SEQUENCES = getattr(kit, "SEQUENCES", None)
    if SEQUENCES and SEQUENCES["runs"]:
        terminalreporter.write_line(
            "membackend kit: {runs} property-based sequences, {steps} verb calls, {injected} injected driver "
            "failures, {typed_errors} typed errors, {oom} out-of-memory results".format(**SEQUENCES))
