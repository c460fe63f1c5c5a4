"""Recipe: the lock that guards who delivers a node's stored copies.

A node's unacknowledged copies (``dmq_delivery.owner = <node-id>``) change hands in
two ways: a live node claims them after ``<node-id>`` disappeared (takeover), or
``<node-id>`` registers again and starts loading them. Both happen while holding
``/dmq/takeover/<node-id>`` (a kazoo Lock), and a claimer checks, holding the lock,
that ``/dmq/node/<node-id>`` is absent. So a returning node either finds its copies
untouched, or waits until a takeover in progress is finished and then finds them
gone; it never loads copies that are being claimed.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState
from kazoo.recipe.lock import Lock

from . import paths

__all__ = ["TakeoverLock"]


class TakeoverLock:
    def __init__(self, client: KazooClient, node_id: str, holder: str):
        self.client = client
        self.node_id = node_id
        self._lock = Lock(client, paths.takeover_lock(node_id), identifier=holder)

    def node_present(self) -> bool:
        return self.client.retry(self.client.exists, paths.node(self.node_id)) is not None

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lock (registration)."""
        return bool(self._lock.acquire(blocking=True, timeout=timeout))

    def try_acquire_absent(self) -> bool:
        """Take the lock at once if free, and keep it only if the node is absent
        (takeover). False: someone else holds it, or the node is alive."""
        if not self._lock.acquire(blocking=False):
            return False
        if self.node_present():
            self.release()
            return False
        return True

    def still_valid(self) -> bool:
        """Still ours and the node still absent: safe to claim the next batch."""
        return (
            self.client.state == KazooState.CONNECTED
            and self._lock.is_acquired
            and not self.node_present()
        )

    def release(self) -> None:
        try:
            self._lock.release()
        except Exception:  # the session is gone: so is the lock
            pass
