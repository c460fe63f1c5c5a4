"""Recipe: which one node of a cluster does a job, by a ZooKeeper lock that places it.

Some work must be done by one node at a time to be done well, though the database keeps it
correct if two do it for a moment: relaying an outbox (``/dmq/outbox_relay/<name>``,
``registry.outboxes.RelayLock``) and delivering an ordered topic (``/dmq/orderer/<topic>``,
``paths.orderer``). Each node that could do the job contends for the lock now and then; the
winner keeps it until it lets go or its session ends, and the lock's data names it, so
ZooKeeper shows the operator who does the job.

**Placement, not a fence.** A node that holds the lock may still be overtaken: its session
can expire while it is frozen, and another node then holds the lock before the first one
learns of it. So whatever the job writes stays fenced in the database (the relay's advisory
lock; an ordered topic's cursor ``holder``); the lock only makes it rare that two nodes try.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock

__all__ = ["PlacementLock"]


class PlacementLock:
    """kazoo's Lock at ``path``, its contender's data ``node_id``.

    The contract for a caller (a reactor-side gate runs these on the node's ZooKeeper
    thread; each blocks for a round trip):

    * ``hold()`` never waits for the lock: it takes it if it is free, else answers False
      and leaves no znode behind. While held it costs one ``exists``, which notices that the
      session that took it ended (the ephemeral znode went with it) and contends again. So
      it is safe to call once a second, forever, by every node that could do the job.
    * ``release()`` lets it go at once (the next ``hold`` of another node takes it); calling
      it while not holding is no error.
    * ``holder()`` names the node that holds it, for anyone (a node, the CLI, a test).
    * ``leave_note(text)`` / ``note()``: a short note the holder leaves for the next one
      (the data of the lock's own znode, which kazoo leaves unused): an orderer that lets
      go cleanly says so, and the next one need not wait out a handover.

    kazoo raises its own errors (``ConnectionLoss``, ``SessionExpiredError``...) while
    ZooKeeper cannot be reached: the caller treats them as "not known to hold it".
    """

    def __init__(self, client: KazooClient, path: str, node_id: str):
        self._client = client
        self.path = path
        self._node_id = node_id
        self._lock: Lock | None = None

    def hold(self) -> bool:
        """True if this node holds the lock (taken now, or still held: one ``exists``)."""
        lock = self._lock
        if lock is not None:
            if lock.node is not None and self._client.exists(f"{self.path}/{lock.node}") is not None:
                return True
            self._lock = None  # its session ended, and the znode with it
        lock = self._client.Lock(self.path, self._node_id)
        if not lock.acquire(blocking=False):
            return False
        self._lock = lock
        return True

    def release(self) -> None:
        """Let the lock go (another node's next ``hold`` takes it); not held is no error."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def holder(self) -> str | None:
        """The node id of the holder, None when no node holds it."""
        contenders = self._client.Lock(self.path).contenders()
        return contenders[0] if contenders else None

    def leave_note(self, text: str) -> None:
        """Leave ``text`` for the next holder (replacing any earlier note)."""
        self._client.ensure_path(self.path)
        self._client.set(self.path, text.encode())

    def note(self) -> str:
        """The last note left ("" when none: the path new, or the note cleared)."""
        self._client.ensure_path(self.path)
        data, _ = self._client.get(self.path)
        return data.decode() if data else ""
