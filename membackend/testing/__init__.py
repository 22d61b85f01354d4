"""The conformance kit every backend must pass (a pytest plugin) and its harness.

    pytest --pyargs membackend.testing.conformance --membackend-backend NAME
    pytest --pyargs membackend.testing.conformance --membackend-plugin package.module:MyBackend

Needs the ``kit`` extra (``pip install membackend[kit]``: pytest and hypothesis).
"""

from .harness import Target, async_work, build_session, checker_for, driver_view, inject_failures, parse_target

__all__ = ["Target", "async_work", "build_session", "checker_for", "driver_view", "inject_failures", "parse_target"]
