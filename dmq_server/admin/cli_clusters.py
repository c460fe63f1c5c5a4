"""``dmq topic move``: a topic to another PostgreSQL cluster, nothing lost or doubled.

A move is three steps, each safe to repeat (run the command again after a timeout or
a crash and it carries on):

1. **Place.** The registry (ZooKeeper with ``--zk``, else the main cluster's tables)
   names the new cluster and adds the old one to the topic's ``draining`` clusters;
   the command also writes the registry's rows into every cluster it is given
   (``--pg-cluster``), as the nodes do at their next registry read. From then on every
   node sends the topic's new messages to the new cluster, and its consumers are
   attached to the channel on both clusters: the old cluster's copies go on being
   delivered, and acknowledged there.
2. **Fence and drain.** On the old cluster the group commit stores only topics placed
   on it (``insert_messages`` reads the topic's row in the same statement), so once the
   row names the new cluster, and every transaction that began before that has ended
   (``pg_stat_activity``: a statement that read the old placement may still commit), no
   message of the topic can be stored there any more, not even by a node whose view of
   the registry is stale (its producer gets ``SEND_SERVER_ERROR`` and sends again, to
   the new cluster). The row is read, not locked: a lock would cost every batch a
   multixact and a WAL record. The command waits until the old cluster has no copy of
   the topic waiting on any channel and no delayed message, continuously for
   ``--settle`` (longer than the nodes' registry refresh). A node with a stale view
   cannot write the old placement back over the fence (the row's version: schema 19);
   the command still fences again if it sees the old placement, as a node of an older
   version may write it.
3. **Finish.** The old cluster leaves ``draining``; nodes close its channels of the
   topic (they are empty).

No message is lost (every stored copy stays in a cluster whose channels are delivered
until it is empty), and a send is stored on one cluster (the fence refuses it on the
old one, and its retry carries the same session id to the new one), but for a send
stored on the old cluster just before the fence whose answer was lost: its retry
through a node already routing to the new one is stored there too (session ids are
remembered per cluster). docs/operations.md "Several PostgreSQL clusters" is the
operator's guide.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from typing import Any

from dmq_server.admin.cli_support import CliError, cluster_dsns, connect_cluster, open_database, open_registry

__all__ = ["cmd_topic_move", "add_cluster_commands"]


def cmd_topic_move(args: argparse.Namespace) -> None:
    import registry
    from registry.pg import mirror_topics

    from dmq_server.db.admin_steps import topic_leftovers_steps
    from dmq_server.db.steps import run_steps

    def topic_leftovers(conn: Any, topic: str, fenced_at: Any = None) -> Any:
        return run_steps(conn, topic_leftovers_steps(topic, fenced_at))

    others = cluster_dsns(args)
    with ExitStack() as stack:
        conns = {"main": stack.enter_context(open_database(args))}
        for name, dsn in others.items():
            conns[name] = stack.enter_context(connect_cluster(name, dsn))
        reg = stack.enter_context(open_registry(args))
        try:
            spec = reg.get_topic(args.name)
            if spec.ordered and spec.draining and spec.cluster != args.cluster:
                # a key's copies on two draining clusters would have no known order
                raise CliError(
                    f"topic {args.name} is ordered and still draining {', '.join(spec.draining)}: an ordered topic "
                    f"moves one step at a time; finish the move first (dmq topic move {args.name} --cluster "
                    f"{spec.cluster})", 1
                )
            if spec.cluster != args.cluster or args.cluster in spec.draining:
                draining = tuple(sorted((set(spec.draining) | {spec.cluster}) - {args.cluster}))
                reg.place_topic(args.name, args.cluster, draining)
                print(f"topic {args.name}: new messages go to cluster {args.cluster}; "
                      f"draining {', '.join(draining) or 'nothing'}")
            spec = reg.get_topic(args.name)
        except registry.RegistryError as exc:
            raise CliError(str(exc)) from exc
        missing = [c for c in spec.draining if c not in conns]
        if missing and not args.no_wait:
            raise CliError(
                f"cannot wait for cluster(s) {', '.join(missing)} to drain: give --pg-cluster NAME=DSN "
                "for each (the move is recorded; run the command again to wait)", 2
            )
        for conn in conns.values():
            mirror_topics(conn, reg.topics())  # the placement, as every node mirrors it
        if args.no_wait:
            print(f"topic {args.name}: not waiting for the drain (run the command again to finish it)")
            return
        deadline = time.monotonic() + args.timeout
        for cluster in spec.draining:
            _drain(args, conns[cluster], cluster, deadline, topic_leftovers, reg, mirror_topics)
            try:
                now = reg.get_topic(args.name)
                reg.place_topic(args.name, now.cluster, tuple(c for c in now.draining if c != cluster))
            except registry.RegistryError as exc:
                raise CliError(str(exc)) from exc
            for conn in conns.values():
                mirror_topics(conn, reg.topics())
            print(f"topic {args.name}: cluster {cluster} drained")
        print(f"topic {args.name} is on cluster {args.cluster}")


def _drain(args: argparse.Namespace, conn: Any, cluster: str, deadline: float, leftovers: Any,
           reg: Any, mirror: Any) -> None:
    """Until the old cluster shows no copy and no delayed message of the topic, fenced,
    with no transaction left that began before the fence, continuously for ``--settle``
    seconds."""
    quiet_since: float | None = None
    last = None
    _, _, _, _, fenced_at = leftovers(conn, args.name)  # the fence was written before this
    while True:
        placed, pending, delayed, older, db_now = leftovers(conn, args.name, fenced_at)
        now = time.monotonic()
        if placed == cluster:  # a node wrote its stale view back: fence again
            mirror(conn, reg.topics())
            fenced_at = leftovers(conn, args.name)[4]
            quiet_since = None
        elif pending or delayed or older:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= args.settle:
            return
        if (pending, delayed, older) != last:
            print(f"  cluster {cluster}: {pending} copies waiting, {delayed} delayed"
                  + (f", {older} transactions older than the fence" if older else ""), flush=True)
            last = (pending, delayed, older)
        if now > deadline:
            raise CliError(
                f"cluster {cluster} still holds {pending} copies and {delayed} delayed messages of topic "
                f"{args.name} after {args.timeout:g}s: consumers must acknowledge them (the move goes on; run "
                "the command again to wait)", 1
            )
        time.sleep(args.poll)


def add_cluster_commands(tsub: Any) -> None:
    move = tsub.add_parser(
        "move",
        help="place a topic on another PostgreSQL cluster, draining the old one (nothing lost or doubled)",
        description="New messages go to the new cluster at once; the old cluster's copies are delivered "
        "until it is empty, then it is left. Safe to run again. Give --pg-cluster NAME=DSN for the clusters.",
    )
    move.add_argument("name")
    move.add_argument("--cluster", required=True, help="the cluster to place the topic on")
    move.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                      help="longest wait for the old cluster to drain (default 600)")
    move.add_argument("--settle", type=float, default=10.0, metavar="SECONDS",
                      help="how long the old cluster must stay empty (default 10; more than the nodes' "
                      "--registry-refresh)")
    move.add_argument("--poll", type=float, default=0.5, metavar="SECONDS", help=argparse.SUPPRESS)
    move.add_argument("--no-wait", action="store_true", help="place the topic and return; drain later")
    move.set_defaults(func=cmd_topic_move)
