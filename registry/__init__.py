"""The registry of topics, their channels (subscriptions) and live nodes.

Single-node dmq keeps it in PostgreSQL (``registry.pg``); the ZooKeeper
implementation arrives with the cluster work behind the same operations.
"""

from .pg import (
    RegistryError,
    add_channel,
    create_topic,
    delete_topic,
    get_topic,
    remove_channel,
    topics,
)

__all__ = [
    "RegistryError",
    "add_channel",
    "create_topic",
    "delete_topic",
    "get_topic",
    "remove_channel",
    "topics",
]
