"""ZkFragmentAssignment.stop() is bounded whatever kazoo does (fakes for kazoo; the
real-ZooKeeper version is tests/zk/test_stop.py).

A kazoo request made just before ZooKeeper vanished waits for it indefinitely; the
stop must neither wait for it on the reactor's side nor leave it on a thread the
reactor joins at shutdown."""

from __future__ import annotations

import threading

from twisted.internet.task import Clock

from dmq_server.cluster.fragments import ZkFragmentAssignment


class FakeReactor(Clock):
    """A Clock that also collects callFromThread calls, run by ``pump`` on the test thread."""

    def __init__(self):
        super().__init__()
        self.from_threads: list = []
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)

    def callFromThread(self, fn, *args):
        with self.arrived:
            self.from_threads.append((fn, args))
            self.arrived.notify_all()

    def pump(self, timeout: float) -> bool:
        with self.arrived:
            if not self.from_threads and not self.arrived.wait(timeout):
                return False
            calls, self.from_threads = self.from_threads, []
        for fn, args in calls:
            fn(*args)
        return True


class StuckPartitioner:
    """finish() waits for ZooKeeper, which never answers, until the client is stopped."""

    def __init__(self, released: threading.Event):
        self.released = released
        self.finishing = threading.Event()

    def finish(self):
        self.finishing.set()
        self.released.wait()  # kazoo fails the request when the client stops


class FakeClient:
    def __init__(self, released: threading.Event, stop_blocks: bool = False):
        self.connected = True  # kazoo has not noticed yet that ZooKeeper is gone
        self.released = released
        self.stop_blocks = stop_blocks
        self.stopped = threading.Event()
        self.closed = False

    def stop(self):
        self.stopped.set()
        if self.stop_blocks:
            threading.Event().wait()  # never returns
        self.released.set()

    def close(self):
        self.closed = True


def _assignment(reactor, client, partitioner) -> ZkFragmentAssignment:
    assignment = ZkFragmentAssignment(
        lambda: client, 8, reactor, "node-a", leave_timeout=0.2, stop_timeout=8.0
    )
    assignment._client, assignment._partitioner = client, partitioner
    return assignment


def test_a_stuck_leave_is_abandoned_and_the_client_stopped():
    """finish() blocks; after leave_timeout the client is stopped (which fails the
    stuck request) and stop()'s Deferred fires through callFromThread, before the
    reactor-side bound."""
    released = threading.Event()
    reactor, client, partitioner = FakeReactor(), FakeClient(released), StuckPartitioner(released)
    done = _assignment(reactor, client, partitioner).stop()
    assert reactor.pump(timeout=10), "the stop thread never reported back"
    assert partitioner.finishing.is_set() and client.stopped.is_set()
    assert done.called
    assert reactor.getDelayedCalls() == []  # the give-up timer was cancelled


def test_stop_fires_at_its_bound_even_if_closing_the_client_hangs_too():
    """Both the leave and the client's stop hang: stop() still fires when the clock
    reaches stop_timeout, and the stuck work is on daemon threads only (not the
    reactor's pool, which would keep the process from exiting)."""
    released = threading.Event()
    reactor = FakeReactor()
    client, partitioner = FakeClient(released, stop_blocks=True), StuckPartitioner(released)
    done = _assignment(reactor, client, partitioner).stop()
    assert client.stopped.wait(10)
    reactor.advance(7.9)
    assert not done.called
    reactor.advance(0.1)
    assert done.called
    stuck = [t for t in threading.enumerate() if t.name.startswith("dmq-delay-partitioner")]
    assert stuck and all(t.daemon for t in stuck)


def test_a_client_connected_while_stopping_is_stopped_and_closed():
    """stop() while the partitioner thread is still connecting finds no client to close;
    the client that connect() returns afterwards is stopped and closed by the thread
    (it used to be kept, with its session and sockets, for the life of the process)."""
    connecting, proceed = threading.Event(), threading.Event()
    client = FakeClient(threading.Event())

    def connect():
        connecting.set()
        proceed.wait(10)
        return client

    assignment = ZkFragmentAssignment(connect, 8, FakeReactor(), "node-a", leave_timeout=0.2)
    assignment.start(lambda owned: None)
    assert connecting.wait(10)
    assignment._stop_blocking()  # the blocking half of stop(): no client yet
    assert not client.stopped.is_set()
    proceed.set()
    assignment._thread.join(10)
    assert not assignment._thread.is_alive()
    assert client.stopped.is_set() and client.closed
