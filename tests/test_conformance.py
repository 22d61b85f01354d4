"""The conformance kit against this repository's targets (``membackend_targets`` in pyproject.toml):
host, the VMM backend on every simulated profile, and the third-party example fixture.

The star import brings every ``test_*`` rule of the kit (its ``__all__`` is computed from
the module), so a rule added to the kit runs here without editing this file.
"""

from membackend.testing.conformance import *  # noqa: F401,F403
