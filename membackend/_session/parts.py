"""The session's parts and the one function that composes them (:func:`compose`).

=============== =================================================== ===========================================
part            module                                              what it is
=============== =================================================== ===========================================
checks          :mod:`.checks`                                      the arguments, the typed-error wrapper
permits         :mod:`.permits`                                     the reservations' locks
views           :mod:`.views`                                       live tensor views
members         :mod:`.members`                                     the backend's optional members, read once
headroom table  ``membackend.platform.HeadroomByDevice``            one ``Headroom`` per device
bound verbs     :mod:`.binding`                                     the verbs through the observers
fencing         :mod:`.fencing`                                     tokens, waits, fences (G2)
hot verbs       :mod:`.hot`                                         ``fault`` and ``free``: one body each
lifecycle       :mod:`.lifecycle`                                   reserve, release, close's releases
headroom        :mod:`.headroom`                                    budgets, the headroom verbs, the hand-down
optional        :mod:`.optional`                                    the backend's optional members and hooks
=============== =================================================== ===========================================

:class:`Books` are what a session keeps for its whole life (made once); :class:`Parts` are made again for each
binding (an observer added), over the same books. No part holds the session or another part: each receives
the callables it uses, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .._ledger import Ledger
from ..platform import HeadroomByDevice
from ..types import Reservation
from .binding import Bound, bind
from .checks import Checks, in_range
from .fencing import Fencing
from .headroom import SessionHeadroom
from .hot import FaultVerb, FreeVerb, hot_verbs
from .lifecycle import Lifecycle
from .members import Members
from .optional import Optional
from .permits import PERMITS, Permits, locker
from .views import Views


@dataclass
class Books:
    """What one session keeps for its whole life, whatever its observers."""

    backend: Any
    name: str
    members: Members
    checks: Checks
    ledger: Ledger
    headrooms: HeadroomByDevice
    #: live reservations -> the permit (see Permits) that serialises verbs on each; the permit is also the
    #: reservation's seat (``Reservation._seat``), where the hot verbs find it
    live: dict[Reservation, list[Any]] = field(default_factory=dict)
    #: this session's token in its live reservations' permits (see Permits)
    owner: object = field(default_factory=object)
    permits: Permits = field(default_factory=lambda: PERMITS)
    #: reservations with (or recently with) live tensor views -> {view key: (offset, end)}
    view_table: dict[Reservation, dict[int, tuple[int, int]]] = field(default_factory=dict)
    #: reservation id -> how often a fence began and ended taking its waited tokens off (odd: under way)
    moving: dict[int, int] = field(default_factory=dict)
    #: reservation id -> how many frees of it reached the backend (Session.backing_changes)
    frees: dict[int, int] = field(default_factory=dict)
    #: ``lock_of(r, verb)``: what ``with`` takes to hold a reservation's permit (:func:`.permits.locker`)
    lock_of: Callable[[Any, str], Any] = field(init=False)
    views: Views = field(init=False)

    def __post_init__(self) -> None:
        self.lock_of = locker(self.live, self.permits, self.checks.refuse)
        self.views = Views(self.view_table, self.lock_of, in_range, self.ledger.check_alive)


@dataclass(frozen=True)
class Parts:
    """The parts of a session bound for its observers now (made by :func:`compose`)."""

    bound: Bound
    fencing: Fencing
    fault: FaultVerb
    free: FreeVerb
    lifecycle: Lifecycle
    headroom: SessionHeadroom
    optional: Optional


def compose(books: Books, observers: list[Any]) -> Parts:
    """Every part over ``books``, with the verbs bound for ``observers`` (``PluginError``, and nothing made, for
    a refused observer)."""
    bound = bind(books.backend, books.name, observers)
    checks, ledger = books.checks, books.ledger

    def backend_fence(device: Any, reservation: Any) -> None:
        checks.call("fence", bound.fence, device, reservation)

    fencing = Fencing(books.live, books.permits, ledger, books.moving, books.lock_of, checks.device, backend_fence)
    fault, free = hot_verbs(books.owner, books.permits, ledger, books.frees, books.view_table, books.views.check,
                            fencing.wait_tokens, checks.refuse, in_range, checks.failed, bound.fault, bound.free)
    lifecycle = Lifecycle(books.name, books.live, books.owner, books.permits, books.view_table, books.views.check,
                          books.moving, books.frees, ledger, fencing.wait_tokens, checks.device, checks.refuse,
                          checks.failed, bound.reserve, bound.release_reservation)
    headroom = SessionHeadroom(books.headrooms, checks.device, checks.budget, bound.budget_query,
                               books.backend.membackend_budget_query)
    optional = Optional(books.name, books.members, bound.trim, bound.inspect, checks.device, checks.call,
                        ledger.devices)
    return Parts(bound, fencing, fault, free, lifecycle, headroom, optional)
