"""Several PostgreSQL clusters: each database knows which cluster it is, and its ids.

A node connects to the main cluster (``--pg-dsn`` or the embedded PostgreSQL) and to
every ``--pg-cluster NAME=DSN``. Before anything is stored, ``place_clusters`` makes sure
that

* every cluster name has an id slot, assigned once on the main cluster's database
  (``dmq_cluster``, under an advisory lock, the lowest free slot; ``main`` is slot 0);
* every database is the cluster it is named as (``dmq_cluster_self``): a database
  already claimed by another name (one DSN given for two clusters, or the main
  database given as another cluster) refuses the start, naming both;
* every database draws the ids of its messages, delayed messages and dead letters from
  its slot, ``[slot << 48, (slot + 1) << 48)``: ids never collide across clusters, and an
  id names its cluster (``cluster_of_id``), so an ack, a dead letter's replay or a trace
  goes to the right database without a lookup. 2^48 ids last a cluster 89 years at
  100,000 messages a second, and every id stays below 2^53, exact in JavaScript (the
  web console).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from dmq_server.db.steps import Statement, Steps, run_steps
from dmq_server.db.worker import connect

__all__ = ["SLOT_SHIFT", "ClusterMismatch", "place_clusters", "assign_slots_steps", "claim_cluster_steps",
           "slot_of_id", "first_id"]

SLOT_SHIFT = 48


class ClusterMismatch(Exception):
    """A database is not the cluster it was given as; the message says which it is."""


def slot_of_id(message_id: int) -> int:
    """The id slot of the cluster that drew ``message_id``."""
    return message_id >> SLOT_SHIFT


def first_id(slot: int) -> int:
    return max(slot << SLOT_SHIFT, 1)


def place_clusters(dsns: Mapping[str, str]) -> dict[str, int]:
    """Blocking: give every cluster of ``dsns`` (``main`` first) its slot and claim each
    database for its cluster; returns name -> slot. ``ClusterMismatch`` if a database
    belongs to another cluster; ``StorageError`` if one cannot be reached."""
    with connect(dsns["main"]) as conn:
        with conn.transaction():
            slots = run_steps(conn, assign_slots_steps(list(dsns)))
    missing = [name for name in dsns if name not in slots]
    if missing:
        raise ClusterMismatch(f"no id slot left for clusters {missing}: at most 32 clusters, ever")
    for name, dsn in dsns.items():
        with connect(dsn, autocommit=True) as conn:
            run_steps(conn, claim_cluster_steps(name, slots[name]))
    return {name: slots[name] for name in dsns}


def assign_slots_steps(names: Sequence[str]) -> Steps:
    """On the main cluster's database, in one transaction: a slot for every name that has
    none (the lowest free one, while one is free); returns every cluster's name -> slot."""
    yield Statement("lock_clusters", {})
    for name in names:
        yield Statement("add_cluster", {"name": name})
    return {name: slot for name, slot in (yield Statement("list_clusters", {}))}


def claim_cluster_steps(name: str, slot: int) -> Steps:
    """Claim this database for cluster ``name`` (once) and move its id sequences into the
    slot; ``ClusterMismatch`` if another cluster claimed it."""
    claimed = yield Statement("claim_cluster_self", {"name": name, "slot": slot})
    if not claimed:
        ((other, other_slot, _),) = yield Statement("cluster_self", {})
        raise ClusterMismatch(
            f"the database of cluster {name!r} is already claimed by cluster {other!r} (slot {other_slot}): "
            "is one DSN given for two clusters?"
        )
    if slot:
        yield Statement("raise_id_sequences", {"floor": first_id(slot)})


def describe(slots: Mapping[str, int]) -> str:
    """``name (slot n)`` for logs."""
    return ", ".join(f"{name} (id slot {slot})" for name, slot in slots.items())
