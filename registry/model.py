"""What the registry holds: topics with their channels, and live nodes.

Plain data and its JSON encoding in znodes; no IO, no third-party imports, so the
client library can read the registry without the server's dependencies.
``TopicSpec`` is the one type for a topic's settings: both registries (ZooKeeper
and PostgreSQL) return it, and the broker, the admin surfaces and the CLI take it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RegistryError", "TopicSpec", "NodeInfo", "encode_topic", "decode_topic", "STORES"]

STORES = ("reliable", "fast")


class RegistryError(Exception):
    """A registry operation was refused or could not be done; the message says why."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    store: str = "reliable"
    msg_timeout_ms: int = 60000
    rate_limit: int | None = None
    ttl_ms: int | None = None
    max_attempts: int | None = None
    channels: tuple[str, ...] = ()
    # the PostgreSQL cluster its messages are stored on (``--pg-cluster``; ``main`` is
    # --pg-dsn or the embedded PostgreSQL), and the clusters it was moved away from whose
    # copies are still being delivered (``dmq topic move``)
    cluster: str = "main"
    draining: tuple[str, ...] = ()
    # per channel, at most one copy of a message key in flight at a time (``--ordered``,
    # issue 45 §2); last, with a default, so the positional constructions above keep working
    ordered: bool = False
    # how long the topic keeps a message every channel is done with (issue 46: replay from the
    # store); None: the server's --message-retention
    retention_ms: int | None = None
    # which read of the registry this is, compared in order: (the creation time in ms of
    # ZooKeeper's /dmq/topic, the topic znode's mzxid), or without ZooKeeper (0, the main
    # cluster's ``dmq_topic.version``). Every database's copy of the topic's row is replaced
    # only by one at least as new (schema 19), so a node with a stale view cannot put back a
    # placement a move fenced. Not a setting: two specs alike but for it are equal.
    version: tuple[int, int] = field(default=(0, 0), compare=False)

    @property
    def clusters(self) -> tuple[str, ...]:
        """Every cluster holding copies of this topic: where it is placed, then those
        draining."""
        return (self.cluster, *(c for c in self.draining if c != self.cluster))


def encode_topic(spec: Any) -> bytes:
    """The data of ``/dmq/topic/<name>``: the settings, not the channels (those are children)."""
    return json.dumps(
        {
            "store": spec.store,
            "msg_timeout_ms": spec.msg_timeout_ms,
            "rate_limit": spec.rate_limit,
            "ttl_ms": spec.ttl_ms,
            "max_attempts": spec.max_attempts,
            "cluster": spec.cluster,
            "draining": list(spec.draining),
            "ordered": spec.ordered,
            "retention_ms": spec.retention_ms,
        },
        sort_keys=True,
    ).encode()


def _optional_int(data: dict, key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def decode_topic(
    name: str, data: bytes, channels: list[str] | tuple[str, ...], version: tuple[int, int] = (0, 0)
) -> TopicSpec:
    """A topic from its znode; unreadable or missing fields take the defaults, so a
    topic created by hand (``create /dmq/topic/orders``) is a reliable topic, and one
    written before a setting existed (``ordered``: schema 17) has that setting off."""
    try:
        values = json.loads(data.decode()) if data else {}
    except (UnicodeDecodeError, ValueError):
        values = {}
    if not isinstance(values, dict):
        values = {}
    raw_store, raw_cluster, raw_draining = values.get("store"), values.get("cluster"), values.get("draining")
    store = raw_store if isinstance(raw_store, str) and raw_store in STORES else "reliable"
    timeout = _optional_int(values, "msg_timeout_ms") or 60000
    cluster = raw_cluster if isinstance(raw_cluster, str) and raw_cluster else "main"
    draining = raw_draining if isinstance(raw_draining, list) else []
    return TopicSpec(
        name,
        store,
        timeout,
        _optional_int(values, "rate_limit"),
        _optional_int(values, "ttl_ms"),
        _optional_int(values, "max_attempts"),
        tuple(sorted(channels)),
        cluster,
        tuple(str(c) for c in draining if isinstance(c, str) and c),
        values.get("ordered") is True,
        _optional_int(values, "retention_ms"),
        version,
    )


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One live dmq server, as registered in its ephemeral ``/dmq/node/<id>``."""

    node_id: str
    host: str
    tcp_port: int
    http_port: int
    version: str = ""
    start_time: float = 0.0
    last_heartbeat: float = 0.0
    hostname: str = ""
    instance: str = ""  # changes with every process start: tells incarnations apart
    fast_topics: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the PostgreSQL incarnation (dmq_owner.id) whose messages this process stores: a
    # takeover leaves it alone while this registration lives
    incarnation: int = 0
    # the incarnations it stores as on the other PostgreSQL clusters (--pg-cluster), by name
    incarnations: dict[str, int] = field(default_factory=dict)

    def incarnation_on(self, cluster: str) -> int:
        """Its incarnation on ``cluster`` (0: none named)."""
        return self.incarnation if cluster == "main" else self.incarnations.get(cluster, 0)

    @property
    def tcp_address(self) -> str:
        return f"{self.host}:{self.tcp_port}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    def encode(self) -> bytes:
        return json.dumps(
            {
                "node_id": self.node_id,
                "host": self.host,
                "tcp_port": self.tcp_port,
                "http_port": self.http_port,
                "version": self.version,
                "start_time": self.start_time,
                "last_heartbeat": self.last_heartbeat,
                "hostname": self.hostname,
                "instance": self.instance,
                "fast_topics": {k: list(v) for k, v in sorted(self.fast_topics.items())},
                "incarnation": self.incarnation,
                "incarnations": dict(sorted(self.incarnations.items())),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, node_id: str, data: bytes) -> "NodeInfo | None":
        """None for data that does not describe a reachable node."""
        try:
            values = json.loads(data.decode())
            fast = values.get("fast_topics") or {}
            return cls(
                node_id,
                str(values["host"]),
                int(values["tcp_port"]),
                int(values["http_port"]),
                str(values.get("version", "")),
                float(values.get("start_time", 0.0)),
                float(values.get("last_heartbeat", 0.0)),
                str(values.get("hostname", "")),
                str(values.get("instance", "")),
                {str(k): tuple(str(c) for c in v) for k, v in fast.items()},
                int(values.get("incarnation", 0)),
                {str(k): int(v) for k, v in (values.get("incarnations") or {}).items()},
            )
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            return None
