"""The ZooKeeper registry (kazoo): topics and channels as znodes, nodes as ephemerals.

``connect(address)`` starts a kazoo client for ``host:port[,host:port...][/chroot]``
(creating the chroot if needed) and gives up with a ``RegistryError`` after a
bounded time. ``ZkRegistry(client)`` implements ``registry.interface.Registry``.

Every operation is an idempotent inner function run under ``client.retry`` (kazoo's
retry policy: connection loss and timeouts are retried with backoff). Where a retry
cannot tell "I did it before the connection dropped" from "someone else did it",
the first attempt decides: a topic that existed before our first ``create`` is a
duplicate, one that appeared during a retry is ours.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.handlers.threading import KazooTimeoutError

from . import paths
from .interface import Registry, check_name, check_settings
from .model import NodeInfo, RegistryError, TopicSpec, decode_topic, encode_topic

__all__ = ["ZkRegistry", "connect", "make_client", "when_connected", "COMMAND_RETRY"]

#: kazoo retry policy for registry operations: about 10 s of tries, then the error
COMMAND_RETRY = {"max_tries": 8, "delay": 0.05, "backoff": 2, "max_delay": 2.0, "max_jitter": 0.2}
#: reconnect forever once a session exists (the server must outlive ZooKeeper restarts)
CONNECTION_RETRY = {"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 2.0, "max_jitter": 0.2}


def make_client(address: str, *, session_timeout: float = 10.0, security: dict[str, Any] | None = None) -> KazooClient:
    """A kazoo client whose ``retry`` gives up as soon as the connection is gone
    (kazoo would otherwise queue the retried request until ZooKeeper is back).
    ``security``: kazoo's SASL and TLS arguments (``Options.zk_security``)."""
    hosts, chroot = paths.parse_address(address)
    holder: list[KazooClient] = []
    client = KazooClient(
        hosts=hosts + chroot,
        timeout=session_timeout,
        connection_retry=dict(CONNECTION_RETRY),
        command_retry=dict(COMMAND_RETRY, interrupt=lambda: bool(holder) and not holder[0].connected),
        **(security or {}),
    )
    holder.append(client)
    return client


def when_connected(client: KazooClient, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` if the client is connected now, else ConnectionLoss at once: a
    kazoo request made while disconnected waits until ZooKeeper is back, however long."""
    if not client.connected:
        raise ConnectionLoss("not connected to ZooKeeper")
    return fn(*args, **kwargs)


def _start(client: KazooClient, address: str, timeout: float) -> None:
    try:
        client.start(timeout=timeout)
    except KazooTimeoutError:
        client.stop()
        client.close()
        raise RegistryError(
            f"cannot reach ZooKeeper at {address} within {timeout:g}s "
            "(is it running, is the address right, and are its SASL or TLS settings the server's?)"
        ) from None
    except Exception as exc:  # kazoo's SASL and TLS failures (their messages are often empty)
        client.stop()
        client.close()
        raise RegistryError(f"cannot open a ZooKeeper session at {address}: {type(exc).__name__} {exc}".rstrip()) from None


def connect(
    address: str, *, timeout: float = 30.0, session_timeout: float = 10.0, security: dict[str, Any] | None = None
) -> KazooClient:
    """A started client with a session, chroot and base paths in place.

    Raises RegistryError when no ZooKeeper server answered within ``timeout`` seconds.
    """
    hosts, chroot = paths.parse_address(address)
    if chroot:
        # kazoo needs the chroot to exist before a chrooted client may use it
        bootstrap = make_client(hosts, session_timeout=session_timeout, security=security)
        _start(bootstrap, address, timeout)
        try:
            _named(address, bootstrap.retry, bootstrap.ensure_path, chroot)
        finally:
            bootstrap.stop()
            bootstrap.close()
    client = make_client(address, session_timeout=session_timeout, security=security)
    _start(client, address, timeout)
    # /dmq/topic is left to ZkRegistry.seed (or the first topic created)
    try:
        for path in (paths.NODES, paths.TAKEOVER):
            _named(address, client.retry, client.ensure_path, path)
    except RegistryError:
        client.stop()
        client.close()
        raise
    return client


def _named(address: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its kazoo failure turned into a RegistryError that names it (kazoo's
    SASL and TLS failures often have empty messages)."""
    try:
        return fn(*args)
    except KazooException as exc:
        detail = f"{type(exc).__name__} {exc}".strip()
        raise RegistryError(
            f"ZooKeeper at {address} refused or dropped the session: {detail} "
            "(are --zk-sasl-user/--zk-sasl-password or the TLS settings the server's?)"
        ) from None


def _once_then_retry(client: KazooClient, inner: Callable[[bool], Any]) -> Any:
    """Run ``inner(first_attempt)`` under the client's retry policy."""
    attempts = [0]

    def attempt() -> Any:
        attempts[0] += 1
        return inner(attempts[0] == 1)

    return client.retry(attempt)


class ZkRegistry(Registry):
    """The Registry interface over a started kazoo client."""

    def __init__(self, client: KazooClient):
        self.client = client

    # -- reading ------------------------------------------------------------------------
    def topics(self) -> list[TopicSpec]:
        return self.client.retry(self._read_topics)

    def _read_topics(self) -> list[TopicSpec]:
        found = []
        try:
            names, parent = self.client.get_children(paths.TOPICS, include_data=True)
        except NoNodeError:  # nothing registered yet
            return []
        for name in sorted(names):
            spec = self._read_topic(name, epoch=parent.ctime)
            if spec is not None:
                found.append(spec)
        return found

    def _read_topic(self, name: str, watch: Any = None, epoch: int | None = None) -> TopicSpec | None:
        """None if the topic vanished while we looked. Its version (``TopicSpec.version``)
        is the registry's epoch, the creation time of /dmq/topic (``epoch``, else read),
        then the znode's last change (mzxid)."""
        try:
            if epoch is None:
                parent = self.client.exists(paths.TOPICS)
                if parent is None:
                    return None
                epoch = parent.ctime
            data, stat = self.client.get(paths.topic(name), watch=watch)
            channels = self.client.get_children(paths.topic(name), watch=watch)
        except NoNodeError:
            return None
        return decode_topic(name, data, channels, (epoch, stat.mzxid))

    def get_topic(self, name: str) -> TopicSpec:
        check_name("topic", name)
        spec = self.client.retry(self._read_topic, name)
        if spec is None:
            raise RegistryError(f"no such topic {name!r}")
        return spec

    def nodes(self) -> list[NodeInfo]:
        return self.client.retry(self._read_nodes)

    def _read_nodes(self, watch: Any = None) -> list[NodeInfo]:
        found = []
        for child in sorted(self.client.get_children(paths.NODES, watch=watch)):
            node_id = paths.node_id_of(child)
            try:
                data, _ = self.client.get(paths.node(node_id), watch=watch)
            except NoNodeError:
                continue
            info = NodeInfo.decode(node_id, data)
            if info is not None:
                found.append(info)
        return found

    # -- writing ------------------------------------------------------------------------
    def create_topic(
        self,
        name: str,
        *,
        store: str = "reliable",
        msg_timeout_ms: int = 60000,
        rate_limit: int | None = None,
        ttl_ms: int | None = None,
        max_attempts: int | None = None,
        cluster: str = "main",
        ordered: bool = False,
        retention_ms: int | None = None,
    ) -> None:
        check_name("topic", name)
        _check_znode("topic", name)
        check_settings(store, msg_timeout_ms, ordered, retention_ms)
        self.check_cluster(cluster)
        data = encode_topic(
            TopicSpec(name, store, msg_timeout_ms, rate_limit, ttl_ms, max_attempts, cluster=cluster, ordered=ordered,
                      retention_ms=retention_ms)
        )

        def inner(first: bool) -> None:
            try:
                self.client.create(paths.topic(name), data, makepath=True)
            except NodeExistsError:
                if first:
                    raise RegistryError(f"topic {name!r} already exists") from None

        _once_then_retry(self.client, inner)

    # -- clusters -------------------------------------------------------------------------
    def clusters(self) -> list[str]:
        """The PostgreSQL clusters the nodes connect to (``main`` always)."""
        try:
            names = self.client.retry(self.client.get_children, paths.CLUSTERS)
        except NoNodeError:
            names = []
        return sorted({"main", *names})

    def add_cluster(self, name: str) -> None:
        """Record a cluster a node connects to (idempotent)."""
        self.client.retry(self.client.ensure_path, paths.cluster(name))

    def check_cluster(self, cluster: str) -> None:
        known = self.clusters()
        if cluster not in known:
            raise RegistryError(
                f"unknown cluster {cluster!r}: the clusters are {', '.join(known)} "
                "(a cluster is known once a node started with --pg-cluster NAME=DSN)"
            )

    def place_topic(self, name: str, cluster: str, draining: Any) -> tuple[str, tuple[str, ...]]:
        """Set a topic's cluster and the clusters it drains from; returns the old pair
        (a compare-and-set on the topic's znode version)."""
        check_name("topic", name)
        self.check_cluster(cluster)

        def inner() -> tuple[str, tuple[str, ...]]:
            while True:
                try:
                    data, stat = self.client.get(paths.topic(name))
                except NoNodeError:
                    raise RegistryError(f"no such topic {name!r}") from None
                spec = decode_topic(name, data, ())
                new = dataclasses.replace(spec, cluster=cluster, draining=tuple(draining))
                try:
                    self.client.set(paths.topic(name), encode_topic(new), version=stat.version)
                except BadVersionError:
                    continue  # its settings changed since the read: keep them
                except NoNodeError:
                    raise RegistryError(f"no such topic {name!r}") from None
                return spec.cluster, spec.draining

        return self.client.retry(inner)

    def update_topic(self, spec: Any) -> None:
        """Replace a topic's settings with ``spec``'s (its store, placement and channels are
        left alone): a compare-and-set on the znode as it is now, so a ``dmq topic move``
        between the caller's read and this write is kept, not written back over."""
        check_name("topic", spec.name)
        check_settings(spec.store, spec.msg_timeout_ms, spec.ordered, spec.retention_ms)

        def inner() -> None:
            while True:
                try:
                    data, stat = self.client.get(paths.topic(spec.name))
                except NoNodeError:
                    raise RegistryError(f"no such topic {spec.name!r}") from None
                now = decode_topic(spec.name, data, ())
                new = dataclasses.replace(
                    now, msg_timeout_ms=spec.msg_timeout_ms, rate_limit=spec.rate_limit, ttl_ms=spec.ttl_ms,
                    max_attempts=spec.max_attempts, ordered=spec.ordered, retention_ms=spec.retention_ms,
                )
                try:
                    self.client.set(paths.topic(spec.name), encode_topic(new), version=stat.version)
                    return
                except BadVersionError:
                    continue  # changed since it was read: apply the settings to the new content
                except NoNodeError:
                    raise RegistryError(f"no such topic {spec.name!r}") from None

        self.client.retry(inner)

    def delete_topic(self, name: str) -> None:
        check_name("topic", name)

        def inner(first: bool) -> None:
            # kazoo's recursive delete ignores a missing node: look first
            if self.client.exists(paths.topic(name)) is None:
                if first:
                    raise RegistryError(f"no such topic {name!r}")
                return  # an earlier attempt deleted it before the connection dropped
            for _ in range(10):
                try:
                    self.client.delete(paths.topic(name), recursive=True)
                    return
                except NotEmptyError:  # a channel was added meanwhile: go again
                    continue
            raise RegistryError(f"topic {name!r} keeps getting new channels; try again")

        _once_then_retry(self.client, inner)

    def add_channel(self, topic: str, name: str) -> None:
        check_name("topic", topic)
        check_name("channel", name)
        _check_znode("channel", name)

        def inner(first: bool) -> None:
            try:
                self.client.create(paths.channel(topic, name), b"")
            except NoNodeError:
                raise RegistryError(f"no such topic {topic!r}") from None
            except NodeExistsError:
                if first:
                    raise RegistryError(f"channel {name!r} already exists on topic {topic!r}") from None

        _once_then_retry(self.client, inner)

    def remove_channel(self, topic: str, name: str) -> None:
        check_name("topic", topic)
        check_name("channel", name)

        def inner(first: bool) -> None:
            try:
                self.client.delete(paths.channel(topic, name))
            except NoNodeError:
                if not first:
                    return
                if self.client.exists(paths.topic(topic)) is None:
                    raise RegistryError(f"no such topic {topic!r}") from None
                raise RegistryError(f"no channel {name!r} on topic {topic!r}") from None

        _once_then_retry(self.client, inner)

    def seed(self, specs: list[Any]) -> bool:
        """Create ``/dmq/topic`` holding ``specs``, in one transaction, if it does not
        exist yet: a single node's PostgreSQL registry becomes the cluster's when the
        first node joins. Returns False (and changes nothing) once the registry exists,
        so topics deleted later are never brought back."""

        def inner() -> bool:
            if self.client.exists(paths.TOPICS) is not None:
                return False
            tx = self.client.transaction()
            tx.create(paths.TOPICS, b"")
            for spec in specs:
                tx.create(paths.topic(spec.name), encode_topic(spec))
                for channel in spec.channels:
                    tx.create(paths.channel(spec.name, channel), b"")
            results = tx.commit()
            if isinstance(results[0], NodeExistsError):
                return False  # another node seeded it first
            for result in results:
                if isinstance(result, Exception):
                    raise result
            return True

        return self.client.retry(inner)

    def close(self) -> None:
        self.client.stop()
        self.client.close()


def _check_znode(kind: str, name: str) -> None:
    try:
        paths.check_znode_name(kind, name)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
