"""admin.inspect.registry_read: the views of the channels (``/stats``, the console's
overview) wait for a registry read begun after the request, so a channel registered a
moment ago is listed; never longer than ``wait``, never failing with the read.
tests/integration/test_stats_new_channel.py shows it on a real server."""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from dmq_server.admin.inspect import REGISTRY_WAIT, registry_read
from dmq_server.db.storage_errors import StorageError


class Broker:
    """The broker's registry refresh, answered when the test says."""

    def __init__(self) -> None:
        self.reads: list[tuple[bool, Deferred]] = []

    def refresh_registry(self, fresh: bool = False) -> Deferred:
        d: Deferred = Deferred()
        self.reads.append((fresh, d))
        return d


def _fired(d: Deferred) -> list:
    out: list = []
    d.addBoth(out.append)
    return out


def test_the_view_waits_for_a_read_that_starts_after_it():
    """A fresh read (not one already under way, which may have begun before the channel
    was registered), and the answer once it is applied."""
    clock, broker = Clock(), Broker()
    fired = _fired(registry_read(broker, clock))
    ((fresh, read),) = broker.reads
    assert fresh is True and fired == []
    read.callback([])
    assert fired == [None]
    assert clock.getDelayedCalls() == []  # no timer left behind


def test_a_failed_read_answers_from_what_the_node_knows():
    clock, broker = Clock(), Broker()
    broker.refresh_registry = lambda fresh=False: fail(StorageError("PostgreSQL is down"))
    assert _fired(registry_read(broker, clock)) == [None]
    assert clock.getDelayedCalls() == []


def test_a_slow_read_holds_the_view_no_longer_than_the_wait():
    clock, broker = Clock(), Broker()
    fired = _fired(registry_read(broker, clock))
    clock.advance(REGISTRY_WAIT - 0.01)
    assert fired == []
    clock.advance(0.01)
    assert fired == [None]
    broker.reads[0][1].callback([])  # the read ends later: nothing fires twice
    assert fired == [None]


def test_without_a_broker_there_is_nothing_to_read():
    assert _fired(registry_read(None, Clock())) == [None]
