"""The conformance kit's pytest plugin (entry point ``pytest11``).

Options:

* ``--membackend-backend NAME`` (repeatable): installed backends to check;
  ``NAME:PROFILE`` runs a GPU backend over one simulated profile;
* ``--membackend-plugin MODULE:ATTR`` (repeatable): a backend that need not be
  installed, named by its import path exactly as its entry point would name it
  (a class is built with ``from_settings(settings)`` if it has one, else with no
  arguments; an object is used as it is). The module must be importable
  (installed, on ``PYTHONPATH``, or run ``python -m pytest`` from its directory);
* ``--membackend-profile NAME`` (repeatable, or ``all``): simulated profiles for
  backends given without one that serve GPU devices;
* ``--membackend-examples N``: property-based sequences per target (default 25).

Without targets, the ini value ``membackend_targets`` (a line list) is used,
else ``host``. The plugin only adds options, fixtures and a summary: loaded in
any pytest run, it changes nothing until a test asks for ``membackend_target``,
and it never imports hypothesis (a plain install has none).

The terminal summary prints, per target, what the ledger was checked against
and every check that could not run, with the reason; then the property-based
figures (sequences, verb calls, injected failures, typed errors, out-of-memory
results).
"""

from __future__ import annotations

import sys

import pytest

from .harness import CHECKED, NOT_CHECKED, Target, build_session, checker_for, parse_target, serves_gpus


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("membackend", "membackend conformance kit")
    group.addoption("--membackend-backend", action="append", default=[], metavar="NAME[:PROFILE]",
                    help="installed backend to run the conformance kit against (repeatable)")
    group.addoption("--membackend-plugin", action="append", default=[], metavar="MODULE:ATTR",
                    help="backend class or object to run the kit against, by import path (repeatable)")
    group.addoption("--membackend-profile", action="append", default=[], metavar="PROFILE",
                    help="simulated profile for GPU backends given without one (repeatable; 'all')")
    group.addoption("--membackend-examples", type=int, default=None, metavar="N",
                    help="property-based sequences per target (default 25)")
    parser.addini("membackend_targets", "default targets of the conformance kit", type="linelist", default=[])
    parser.addini("membackend_examples", "property-based sequences per target", default="25")


def _targets(config: pytest.Config) -> list[Target]:
    paths = config.getoption("membackend_plugin")
    names = config.getoption("membackend_backend") or ([] if paths else config.getini("membackend_targets")) \
        or ([] if paths else ["host"])
    profiles = config.getoption("membackend_profile")
    targets = [t for name in names
               for t in parse_target(name, profiles, gpu=bool(profiles) and serves_gpus(name.split(":")[0]))]
    return targets + [Target(path, import_path=True) for path in paths]


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
    session = build_session(membackend_target)
    yield session
    session.close()
    for device in session.devices()[:1]:
        checker_for(session).verify_nothing_left(device)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for target in sorted(set(CHECKED) | set(NOT_CHECKED)):
        skipped = NOT_CHECKED.get(target, {})
        ran = {k: v for k, v in CHECKED.get(target, {}).items() if k not in skipped}
        if ran:
            terminalreporter.write_line(f"membackend kit: {target}: checked: "
                                        + ", ".join(f"{k} ({v})" for k, v in sorted(ran.items())))
        if skipped:
            terminalreporter.write_line(f"membackend kit: {target}: not checked: "
                                        + ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items())))
    # only when the kit ran: importing it needs hypothesis, which a plain install lacks
    kit = sys.modules.get("membackend.testing.conformance")
    sequences = getattr(kit, "SEQUENCES", None)
    if sequences and sequences["runs"]:
        terminalreporter.write_line(
            "membackend kit: {runs} property-based sequences, {steps} verb calls, {injected} injected driver "
            "failures, {typed_errors} typed errors, {oom} out-of-memory results".format(**sequences))
