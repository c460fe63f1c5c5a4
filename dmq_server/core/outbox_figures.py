"""What an operator sees of one outbox (``/metrics``, ``/stats``, ``dmq outbox list``, the console).

The relay (``protocols.outbox_relay``) takes the application database's figures in its
own cycle, at most once every ``MEASURE_EVERY`` seconds, so a scrape or a page costs the
application's database nothing: a scrape reads the last figures taken. Counting a large
outbox would cost a scan each time, so the pending rows are counted up to
``PENDING_BOUND`` only: a count equal to the bound means *at least* that many. The age
of the oldest pending row is that of the row with the lowest id (the primary key's first
entry, one index probe): the row the relay reads next, whose ``created_at`` is its
transaction's start.

The lock holder is told by the application database itself (``pg_locks``), as the
``application_name`` of the session holding the outbox's relay lock, which each relay
sets to ``dmq NODE_ID``: any node, relaying or not, can say which node relays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

__all__ = ["MEASURE_EVERY", "PENDING_BOUND", "HOLDER_PREFIX", "Measured", "OutboxFigures", "OutboxJson",
           "holder_label", "holder_node", "figures_json"]

#: the fewest seconds between two readings of an outbox's figures
MEASURE_EVERY = 1.0
#: pending rows are counted up to this many (a count at the bound means at least that many)
PENDING_BOUND = 10000
#: the lock holder's ``application_name`` starts with this, then the node id
HOLDER_PREFIX = "dmq "
# PostgreSQL keeps the first 63 bytes of an application_name (NAMEDATALEN)
_NAME_BYTES = 63


def holder_label(node_id: str) -> str:
    """The ``application_name`` a relay's connection gives itself: its node, cut to what
    PostgreSQL keeps (whole characters)."""
    return (HOLDER_PREFIX + node_id).encode("utf-8")[:_NAME_BYTES].decode("utf-8", "ignore")


def holder_node(application_name: str | None) -> str | None:
    """The node id in a lock holder's ``application_name``; the name itself when it is not
    a relay's (another program took the lock); None when nobody holds it."""
    if application_name is None:
        return None
    return application_name[len(HOLDER_PREFIX):] if application_name.startswith(HOLDER_PREFIX) else application_name


@dataclass(frozen=True, slots=True)
class Measured:
    """One reading of the application database: pending rows (up to the bound), the age
    of the oldest in seconds (None: none pending) and the lock holder's
    ``application_name`` (None: nobody holds the lock)."""

    pending: int
    oldest_age: float | None
    holder: str | None


@dataclass(frozen=True, slots=True)
class OutboxFigures:
    """One outbox as this node sees it. ``pending``, ``oldest_age`` and ``holder`` are
    from the last reading (None before the first: the database not reached yet);
    ``oldest_age`` is brought forward to now by this node's clock. ``relaying``: this
    node holds the lock (as of its last cycle). ``relayed`` and ``dead_lettered`` count
    rows since this node started. ``last_cycle_age``: seconds since the relay last began a
    cycle (a relay stuck on a database shows it growing). ``attached``: attached at run
    time (``dmq outbox attach``), not given with ``--outbox``."""

    name: str
    schema: str
    database: str
    node_id: str
    relaying: bool
    holder: str | None
    pending: int | None
    oldest_age: float | None
    relayed: int
    dead_lettered: int
    last_cycle_age: float | None
    measured_age: float | None
    attached: bool = False

    @property
    def pending_at_least(self) -> bool:
        """The count stopped at the bound: there are at least ``pending`` rows."""
        return self.pending is not None and self.pending >= PENDING_BOUND

    @property
    def relaying_node(self) -> str | None:
        """The node that relays the outbox: this one, else the lock holder's node."""
        return self.node_id if self.relaying else holder_node(self.holder)


class OutboxJson(TypedDict):
    """An outbox in ``/stats``' ``outboxes`` and the admin API's ``/admin/outboxes``."""

    name: str
    schema: str
    database: str
    node_id: str
    relaying: bool
    relaying_node: str | None
    pending: int | None
    pending_at_least: bool
    oldest_pending_seconds: float | None
    relayed: int
    dead_lettered: int
    last_cycle_seconds_ago: float | None
    measured_seconds_ago: float | None
    attached: bool


def figures_json(figures: OutboxFigures) -> OutboxJson:
    """The JSON shape of an outbox's figures (no DSN: ``database`` is host and name only)."""
    return {
        "name": figures.name,
        "schema": figures.schema,
        "database": figures.database,
        "node_id": figures.node_id,
        "relaying": figures.relaying,
        "relaying_node": figures.relaying_node,
        "pending": figures.pending,
        "pending_at_least": figures.pending_at_least,
        "oldest_pending_seconds": figures.oldest_age,
        "relayed": figures.relayed,
        "dead_lettered": figures.dead_lettered,
        "last_cycle_seconds_ago": figures.last_cycle_age,
        "measured_seconds_ago": figures.measured_age,
        "attached": figures.attached,
    }
