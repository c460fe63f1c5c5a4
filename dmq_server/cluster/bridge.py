"""The one way between kazoo's threads and the Twisted reactor.

kazoo runs its own threads (connection, event dispatch) and its calls block. The
server therefore never calls kazoo on the reactor thread and never lets a kazoo
thread touch reactor state:

* ``bridge.call(fn, *args)`` runs blocking registry work (``fn`` calls kazoo) on the
  bridge's own small thread pool and returns a Deferred that fires on the reactor
  thread (``deferToThreadPool`` delivers through ``callFromThread``);
* ``bridge.relay(fn)`` wraps a function for kazoo to call (state listeners, watches):
  the wrapper only schedules ``fn(*args)`` on the reactor with ``callFromThread``.

Nothing else in the server imports kazoo's threads into the reactor.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThread, deferToThreadPool
from twisted.python.threadpool import ThreadPool

__all__ = ["KazooBridge"]

T = TypeVar("T")


class Client(Protocol):
    """What closing asks of a kazoo client (``kazoo.client.KazooClient``)."""

    def stop(self) -> None: ...
    def close(self) -> None: ...


class KazooBridge:
    def __init__(self, reactor: IReactorFromThreads, threads: int = 3, name: str = "dmq-zk"):
        self._reactor = reactor
        self._pool = ThreadPool(minthreads=1, maxthreads=threads, name=name)
        self._stopped = False

    def start(self) -> None:
        self._pool.start()

    def stop(self) -> None:
        """Wait for running calls to finish and end the threads."""
        if not self._stopped:
            self._stopped = True
            self._pool.stop()

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> Deferred[T]:
        """Run blocking ``fn`` off the reactor; the result arrives on the reactor thread."""
        return deferToThreadPool(self._reactor, self._pool, fn, *args, **kwargs)

    def close_client(self, client: Client) -> Deferred[None]:
        """Stop and close a kazoo client, off the reactor and outside the bridge's pool
        (whose threads may be waiting on that very client); pending requests fail."""

        def close() -> None:
            client.stop()
            client.close()

        return deferToThread(close)

    def relay(self, fn: Callable[..., object]) -> Callable[..., None]:
        """A callable kazoo may call from any thread; ``fn`` runs on the reactor thread."""

        def relayed(*args: object) -> None:
            if not self._stopped:
                self._reactor.callFromThread(fn, *args)

        return relayed
