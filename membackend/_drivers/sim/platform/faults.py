"""Fault injection for the simulated drivers: rules by API name over a seeded random source.

The simulated modules check a call's rules before it runs (``SimPlatform.inject``); a rule that fires fails the
call with its vendor error code, as the real call would fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["FaultPlan", "FaultRule"]


@dataclass
class FaultRule:
    """Fail ``call`` with ``error`` (a vendor error code) on its ``nth`` call, or with ``probability``."""

    call: str
    error: object
    nth: int | None = None
    probability: float = 0.0
    times: int | None = None  # at most this many injections (None: unlimited)
    fired: int = 0


class FaultPlan:
    """Deterministic fault injection: rules by API name, a seeded random source."""

    def __init__(self, rules: list[FaultRule] | None = None, seed: int = 0):
        self.rules = list(rules or [])
        self.rng = random.Random(seed)
        self.calls: dict[str, int] = {}
        self.injected = 0

    def add(self, call: str, error: object, nth: int | None = None, probability: float = 0.0,
            times: int | None = None) -> FaultRule:
        rule = FaultRule(call, error, nth, probability, times)
        self.rules.append(rule)
        return rule

    def check(self, call: str) -> object | None:
        n = self.calls[call] = self.calls.get(call, 0) + 1
        for rule in self.rules:
            if rule.call != call or (rule.times is not None and rule.fired >= rule.times):
                continue
            if (rule.nth is not None and rule.nth == n) or (rule.probability and self.rng.random() < rule.probability):
                rule.fired += 1
                self.injected += 1
                return rule.error
        return None
