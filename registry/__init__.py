"""The registry of topics, their channels (subscriptions) and live nodes.

One interface (``registry.interface.Registry``), two implementations:
``registry.pg`` (PostgreSQL tables; the single-node default) and ``registry.zk``
(ZooKeeper through kazoo; what a cluster uses). ``registry.paths`` is the znode
layout, ``registry.model`` the data, and ``membership``, ``watcher`` and
``takeover_lock`` the ZooKeeper recipes, one class each. The registry knows
nothing of Twisted: the server carries kazoo's callbacks into its reactor with
``dmq_server.cluster.bridge``.

The names below are imported on first use, so reading ``registry.paths`` (as the
client library does) pulls in neither psycopg, Twisted nor kazoo. The module-level
functions (``create_topic(conn, ...)``) are the PostgreSQL registry's.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RegistryError": "model",
    "TopicSpec": "model",
    "NodeInfo": "model",
    "Registry": "interface",
    "PgRegistry": "pg",
    "ZkRegistry": "zk",
    "topics": "pg",
    "get_topic": "pg",
    "create_topic": "pg",
    "delete_topic": "pg",
    "add_channel": "pg",
    "remove_channel": "pg",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
