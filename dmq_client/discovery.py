"""Server discovery through the cluster registry in ZooKeeper (``MqConfig.zk``).

The client learns the dmq servers from the ephemeral znodes under ``/dmq/node``
(layout: ``registry.paths``) instead of a fixed ``servers`` list, as DMQ's client does
(seeds/003, section 一):

* a watch on ``/dmq/node`` reports nodes joining and leaving at once; the client
  connects to a new node (producers route topics to it, subscriptions are renewed on
  it) and closes its connection to a node that left (unanswered sends fail over);
* the topics the client uses (sent to or subscribed) are watched too, so
  ``MqClient.stats()["discovery"]`` shows their channels as the registry has them;
* everything is read again every ``zk_refresh_interval`` (an hour by default) and
  after every new ZooKeeper session, as a safety net for lost watches;
* kazoo connects to the next ZooKeeper server of the ensemble by itself when one
  fails, and keeps trying while none answers; meanwhile the client keeps the servers
  it knows.

Threads: kazoo's own, plus one discovery thread. Watches only set a flag; all reading
and all changes to the connection pool happen on the discovery thread, so kazoo's
threads never block. kazoo is imported only when a client is configured with ``zk``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from registry import paths
from registry.model import NodeInfo, decode_topic

__all__ = ["ZkDiscovery"]

log = logging.getLogger(__name__)


class ZkDiscovery:
    """Keeps ``on_servers(addresses)`` told of the live dmq servers."""

    def __init__(
        self,
        address: str,
        on_servers: Callable[[list[tuple[str, int]]], None],
        *,
        session_timeout: float = 10.0,
        refresh_interval: float = 3600.0,
    ):
        self.address = address
        self._on_servers = on_servers
        self._session_timeout = session_timeout
        self._refresh_interval = refresh_interval
        self._wake = threading.Condition()
        self._dirty = True
        self._closing = False
        self._client: Any = None
        self._thread: threading.Thread | None = None
        self._used: set[str] = set()
        self.nodes: dict[str, NodeInfo] = {}
        self.topics: dict[str, Any] = {}
        self.reads = 0
        self.error = ""

    # -- lifecycle --------------------------------------------------------------------
    def start(self, timeout: float) -> list[tuple[str, int]]:
        """Connect (waiting up to ``timeout``) and read the servers once, arming the
        watches; ``watch()`` then starts reporting changes.

        Returns the servers found; an empty list if ZooKeeper did not answer in time
        (the discovery thread keeps trying and reports servers when it can)."""
        from kazoo.client import KazooClient

        hosts, chroot = paths.parse_address(self.address)
        self._client = KazooClient(
            hosts=hosts + chroot,
            timeout=self._session_timeout,
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 5.0},
            command_retry={"max_tries": 3, "delay": 0.1, "backoff": 2, "max_delay": 1.0},
        )
        self._client.add_listener(self._state_changed)
        event = self._client.start_async()
        event.wait(timeout)
        servers: list[tuple[str, int]] = []
        if self._client.connected:
            with self._wake:
                self._dirty = False  # a watch firing from here on sets it again
            try:
                servers = self._read()
            except Exception as exc:  # a failed read is retried by the thread
                self._changed()
                self.error = str(exc)
                log.warning("dmq discovery: cannot read %s yet: %s", self.address, exc)
        else:
            self.error = f"ZooKeeper at {self.address} did not answer within {timeout:g}s"
            log.warning("dmq discovery: %s; still trying", self.error)
        return servers

    def watch(self) -> None:
        """Start the discovery thread: changes reach ``on_servers`` from now on."""
        self._thread = threading.Thread(target=self._run, name="dmq-discovery", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        if self._client is not None:
            self._client.stop()
            self._client.close()

    def use_topic(self, topic: str) -> None:
        """Watch ``topic`` too (called for every topic sent to or subscribed)."""
        if topic not in self._used:
            with self._wake:
                self._used.add(topic)
                self._dirty = True
                self._wake.notify_all()

    # -- kazoo's threads: only flags ---------------------------------------------------
    def _changed(self, event: Any = None) -> None:
        with self._wake:
            self._dirty = True
            self._wake.notify_all()

    def _state_changed(self, state: str) -> None:
        if state == "CONNECTED":  # watches do not survive a lost connection: read again
            self._changed()

    # -- the discovery thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._dirty and not self._closing:
                    self._wake.wait(self._refresh_interval)
                    if not self._dirty and not self._closing:
                        self._dirty = True  # the periodic full pull
                if self._closing:
                    return
                self._dirty = False
            if not self._client.connected:
                continue  # _state_changed sets the flag again once connected
            try:
                servers = self._read()
            except Exception as exc:
                self.error = str(exc)
                log.warning("dmq discovery: reading %s failed: %s", self.address, exc)
                with self._wake:
                    self._dirty = True
                    self._wake.wait(1.0)
                continue
            try:
                self._on_servers(servers)
            except Exception:
                log.exception("dmq discovery: applying the server list failed")

    def _read(self) -> list[tuple[str, int]]:
        """Read nodes and used topics, arming watches; returns the server addresses."""
        from kazoo.exceptions import NoNodeError

        client = self._client
        nodes: dict[str, NodeInfo] = {}
        try:
            children = client.retry(client.get_children, paths.NODES, watch=self._changed)
        except NoNodeError:
            client.retry(client.exists, paths.NODES, watch=self._changed)
            children = []
        for child in children:
            node_id = paths.node_id_of(child)
            try:
                data, _ = client.retry(client.get, paths.node(node_id))
            except NoNodeError:
                continue
            info = NodeInfo.decode(node_id, data)
            if info is not None:
                nodes[node_id] = info
        topics: dict[str, Any] = {}
        for topic in sorted(self._used):
            path = paths.topic(topic)
            try:
                data, _ = client.retry(client.get, path, watch=self._changed)
                channels = client.retry(client.get_children, path, watch=self._changed)
            except NoNodeError:
                client.retry(client.exists, path, watch=self._changed)
                topics[topic] = None
                continue
            topics[topic] = decode_topic(topic, data, channels)
        self.nodes, self.topics = nodes, topics
        self.reads += 1
        self.error = ""
        return sorted({(n.host, n.tcp_port) for n in nodes.values()})

    def stats(self) -> dict[str, Any]:
        return {
            "zk": self.address,
            "connected": bool(self._client is not None and self._client.connected),
            "nodes": sorted(self.nodes),
            "topics": {t: (list(s.channels) if s is not None else None) for t, s in sorted(self.topics.items())},
            "reads": self.reads,
            "error": self.error,
        }
