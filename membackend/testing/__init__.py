"""The conformance kit every backend must pass (a pytest plugin) and its harness.

    pytest --pyargs membackend.testing.conformance --membackend-backend NAME
"""

from .harness import Target, async_work, build_session, driver_view, inject_failures, parse_target

__all__ = ["Target", "async_work", "build_session", "driver_view", "inject_failures", "parse_target"]
