"""Recipe: this node's ephemeral ``/dmq/node/<node-id>``.

``register()`` creates it (idempotent: a znode this session already owns is just
updated), holding the node's takeover lock (``registry.takeover_lock``) so that no
takeover of this node id is half done when the node starts delivering. A caller that
must do more under the lock first (begin its PostgreSQL incarnation, which a takeover
would otherwise retire before the znode names it) takes it with ``lock()`` and ends
with ``register_locked(lock)``.

A znode left by an earlier process with the same id (killed a moment ago: its
session has not expired yet) is waited for, up to ``stale_wait`` seconds; if it is
still there, a live process uses this id and registration fails with a
``RegistryError`` naming it, rather than letting two processes deliver the same
copies.

``heartbeat()`` rewrites the data with a fresh ``last_heartbeat``; it returns False
when the znode is gone (session lost, or deleted by hand), and the caller registers
again. ``leave()`` deletes it on a clean shutdown. After a lost session (kazoo's
LOST) ephemeral znodes are gone and the caller registers again once CONNECTED.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from . import paths
from .model import NodeInfo, RegistryError
from .takeover_lock import TakeoverLock

__all__ = ["NodeMembership"]


class NodeMembership:
    def __init__(
        self,
        client: KazooClient,
        info: NodeInfo,
        *,
        stale_wait: float = 30.0,
        lock_wait: float = 120.0,
        clock: Callable[[], float] = time.time,
    ):
        self.client = client
        self.info = info
        self.stale_wait = stale_wait
        self.lock_wait = lock_wait
        self._clock = clock
        self._info_lock = threading.Lock()

    @property
    def path(self) -> str:
        return paths.node(self.info.node_id)

    def update(self, **changes: Any) -> NodeInfo:
        """Change what the znode says (written by the next heartbeat or register)."""
        with self._info_lock:
            self.info = dataclasses.replace(self.info, **changes)
            return self.info

    def _data(self) -> bytes:
        return self.update(last_heartbeat=self._clock()).encode()

    # -- register ---------------------------------------------------------------------
    def register(self) -> None:
        lock = self.lock()
        try:
            self._create()
        finally:
            lock.release()

    def lock(self) -> TakeoverLock:
        """Take this node's takeover lock (waiting up to ``lock_wait``): while it is held no
        takeover of this node id runs, so its incarnation can be checked or begun and
        registered (``register_locked``) without a claimer retiring it in between."""
        lock = TakeoverLock(self.client, self.info.node_id, f"register {self.info.instance}")
        if not lock.acquire(self.lock_wait):
            raise RegistryError(
                f"node {self.info.node_id!r}: the takeover lock stayed busy for {self.lock_wait:g}s"
            )
        return lock

    def register_locked(self, lock: TakeoverLock) -> None:
        """Create the znode while holding ``lock`` (from ``lock``), then release it."""
        try:
            self._create()
        finally:
            lock.release()

    def _create(self) -> None:
        deadline = time.monotonic() + self.stale_wait
        while True:
            outcome = self.client.retry(self._try_create)
            if outcome is None:
                return
            # someone else's session holds our id: wait for it to expire
            gone = threading.Event()
            if self.client.retry(self.client.exists, self.path, watch=lambda event: gone.set()) is None:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not gone.wait(remaining):
                other = outcome
                raise RegistryError(
                    f"node id {self.info.node_id!r} is registered by another live process "
                    f"(host {other.host if other else '?'}, started "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(other.start_time)) if other else '?'}); "
                    "give every node its own --node-id"
                )

    def _try_create(self) -> NodeInfo | None:
        """None when the znode is ours now, else what the other holder registered."""
        data = self._data()
        try:
            self.client.create(self.path, data, ephemeral=True, makepath=True)
            return None
        except NodeExistsError:
            pass
        try:
            current, stat = self.client.get(self.path)
        except NoNodeError:
            return self._try_create()
        if stat.ephemeralOwner == self._session_id():
            self.client.set(self.path, data)  # ours: an earlier attempt of this call
            return None
        other = NodeInfo.decode(self.info.node_id, current)
        return other or NodeInfo(self.info.node_id, "?", 0, 0)

    def _session_id(self) -> int | None:
        client_id = self.client.client_id
        return client_id[0] if client_id else None

    # -- heartbeat and leave ------------------------------------------------------------
    def registered(self) -> bool:
        try:
            stat = self.client.retry(self.client.exists, self.path)
        except NoNodeError:
            return False
        return stat is not None and stat.ephemeralOwner == self._session_id()

    def heartbeat(self) -> bool:
        """Refresh the data; False if our znode is gone (register again)."""

        def inner() -> bool:
            try:
                _, stat = self.client.get(self.path)
            except NoNodeError:
                return False
            if stat.ephemeralOwner != self._session_id():
                return False
            try:
                self.client.set(self.path, self._data())
            except NoNodeError:
                return False
            return True

        return self.client.retry(inner)

    def leave(self) -> None:
        """Delete our znode (clean shutdown); nothing if it is already gone."""

        def inner() -> None:
            try:
                _, stat = self.client.get(self.path)
            except NoNodeError:
                return
            if stat.ephemeralOwner == self._session_id():
                try:
                    self.client.delete(self.path)
                except NoNodeError:
                    pass

        self.client.retry(inner)
