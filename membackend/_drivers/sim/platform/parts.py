"""The parts of one :class:`~membackend._drivers.sim.platform.SimPlatform`, built here and nowhere else.

Each part receives the shared :class:`~.state.SimState` (or the items of it it uses) and the bound methods of
the parts built before it that it calls; none holds the platform. The order is the order of what they need:

============== ======================= ==========================================================================
part           module                  calls
============== ======================= ==========================================================================
``contexts``   :mod:`.contexts`        the fault plan
``table``      :mod:`.mappings`        nothing
``streams``    :mod:`.streams`         ``contexts.current``, ``table.handles_in``
``facts``      :mod:`.facts`           ``contexts.device``, ``contexts.current``
``address``    :mod:`.address`         ``table``, ``contexts.current`` / ``check_current``,
                                       ``handles.range_freed`` (the one call back, on a free)
``handles``    :mod:`.handles`         ``table``, ``address.reservations`` / ``quota_used``, ``contexts.device``
                                       / ``check_current``, ``facts.charge``, ``streams.queue`` /
                                       ``release_check``
``host``       :mod:`.hostmem`         ``facts.meminfo`` / ``charge``, ``contexts.device``
``tables``     :mod:`.facts`           the tables of ``address``, ``table``, ``handles``; ``streams.pending_all``
============== ======================= ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import KeysView, Mapping

from ..profiles import Profile
from .address import AddressSpace
from .contexts import Contexts
from .facts import Facts, Tables
from .faults import FaultPlan
from .handles import Handles
from .hostmem import HostMemory
from .mappings import MappingTable
from .state import SimState
from .streams import Streams

__all__ = ["Parts", "build_parts"]


@dataclass(frozen=True)
class Parts:
    """The parts of one simulated platform, over one shared state."""

    state: SimState
    contexts: Contexts
    table: MappingTable
    streams: Streams
    facts: Facts
    address: AddressSpace
    handles: Handles
    host: HostMemory
    tables: Tables


def build_parts(profile: Profile, faults: FaultPlan, environ: Mapping[str, str], hold_bytes: bool) -> Parts:
    """The parts of a simulated process on ``profile``'s machine, seeing the devices ``environ`` makes visible,
    failing calls as ``faults`` says, holding real bytes where ``hold_bytes`` and the operating system allow."""
    state = SimState(profile, environ, hold_bytes)
    contexts = Contexts(state, faults)
    table = MappingTable(state)
    streams = Streams(state, contexts.current, table.handles_in)
    facts = Facts(state, contexts.device, contexts.current)

    def range_freed(live: KeysView[int]) -> None:  # the handles are built next: they map into the address space
        handles.range_freed(live)

    address = AddressSpace(state, table, contexts.current, contexts.check_current, range_freed)
    handles = Handles(state, table, address.reservations, address.quota_used, contexts.device,
                      contexts.check_current, facts.charge, streams.queue, streams.release_check)
    host = HostMemory(state, facts.meminfo, facts.charge, contexts.device)
    tables = Tables(state.lock, address.reservations, table.mappings, handles.handles, streams.pending_all)
    return Parts(state, contexts, table, streams, facts, address, handles, host, tables)
