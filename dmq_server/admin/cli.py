"""``dmq``: the admin command line (topics, channels, stats, migrations).

It talks to PostgreSQL directly (``--pg-dsn``, or the embedded PostgreSQL under
``--data-path``, started for the command and stopped again if it was not
running), so it works whether or not a server is up. Exit status: 0 on
success, 1 on a refused operation (unknown name, duplicate, invalid name, a dead
letter id that is not there), 2 on bad usage, 3 when the database cannot be
reached, 141 when the reader of its output went away (``dmq dlq list | head``:
quietly, as a command killed by SIGPIPE).

Why one long module: the parser of every subcommand and the topic and channel commands;
the dead-letter, delay and client commands are in cli_operations.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dmq_server.admin.cli_support import CliError, connect_cluster, open_database as _database, open_registry as _registry
from dmq_server.core.errors import Refused
from dmq_client.spelling import parse_duration

if TYPE_CHECKING:  # the commands import what they use when they run
    from registry.model import NodeInfo, TopicSpec

__all__ = ["main"]


def _duration_ms(text: str) -> int:
    try:
        return int(parse_duration(text) * 1000)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc


def _topic_dict(row: TopicSpec) -> dict:
    return {
        "name": row.name,
        "store": row.store,
        "msg_timeout_ms": row.msg_timeout_ms,
        "rate_limit": row.rate_limit,
        "ttl_ms": row.ttl_ms,
        "max_attempts": row.max_attempts,
        "ordered": row.ordered,
        "retention_ms": row.retention_ms,
        "channels": list(row.channels),
        "cluster": row.cluster,
        "draining": list(row.draining),
    }


def cmd_topic(args: argparse.Namespace) -> None:
    import registry

    with _registry(args) as reg:
        try:
            if args.action == "create":
                reg.create_topic(
                    args.name,
                    store=args.store,
                    msg_timeout_ms=_duration_ms(args.msg_timeout),
                    cluster=args.cluster,
                    ordered=args.ordered,
                    **_limits(args),
                )
                print(f"created {'ordered ' if args.ordered else ''}topic {args.name}"
                      + (f" on cluster {args.cluster}" if args.cluster != "main" else ""))
            elif args.action == "delete":
                reg.delete_topic(args.name)
                print(f"deleted topic {args.name}")
            elif args.action == "list":
                rows = reg.topics()
                if args.json:
                    print(json.dumps([_topic_dict(r) for r in rows], indent=2))
                else:
                    for row in rows:
                        where = row.cluster + "".join(f" (draining {c})" for c in row.draining)
                        store = row.store + (" ordered" if row.ordered else "")
                        print(f"{row.name}\t{store}\tchannels: {', '.join(row.channels) or '-'}\tcluster: {where}")
            elif args.action == "show":
                print(json.dumps(_topic_dict(reg.get_topic(args.name)), indent=2))
        except registry.RegistryError as exc:
            raise CliError(str(exc)) from exc


def _setting(kind: str) -> Callable[[str], int | None]:
    """argparse type for `topic update`: a value, or ``none`` to remove the limit."""

    def parse(text: str) -> int | None:
        if text.strip().lower() == "none":
            return None
        if kind == "count":
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a whole number (or none): {text!r}") from None
        try:
            return int(parse_duration(text) * 1000)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def cmd_topic_update(args: argparse.Namespace) -> None:
    """Change a topic's rate limit, TTL, max attempts, message timeout or ordering in place:
    its channels, stored messages and dead letters stay. In a cluster (--zk) ZooKeeper holds
    the settings and every node mirrors them; on one node the server reads them at its
    next registry refresh (--registry-refresh)."""
    import dataclasses

    import registry
    from registry.interface import check_name

    from dmq_server.admin.operations import TOPIC_SETTINGS, merge_topic_settings, update_topic_steps
    from dmq_server.db.steps import run_steps

    changes = {key: getattr(args, key) for key in TOPIC_SETTINGS if getattr(args, key) is not _UNSET}
    try:
        check_name("topic", args.name)
        if args.zk:
            with _registry(args) as reg:
                spec = reg.get_topic(args.name)
                before = {key: getattr(spec, key) for key in TOPIC_SETTINGS}
                after = merge_topic_settings({**before, "store": spec.store}, changes)
                reg.update_topic(dataclasses.replace(spec, **after))
        else:
            with _database(args) as conn, conn.transaction():
                before, after = run_steps(conn, update_topic_steps(args.name, changes))
    except registry.RegistryError as exc:
        raise CliError(str(exc)) from exc
    except Refused as exc:
        raise CliError.of(exc) from exc
    changed = [
        f"{key} {_show(before[key])} -> {_show(after[key])}" for key in TOPIC_SETTINGS if before[key] != after[key]
    ]
    print(f"updated topic {args.name}: " + (", ".join(changed) if changed else "no change"))


_UNSET = object()  # `topic update` leaves a setting alone unless given


def _show(value: int | bool | None) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _limits(args: argparse.Namespace) -> dict:
    """--rate-limit, --ttl, --max-attempts and --retention of `topic create` (omitted: none)."""
    limits: dict = {}
    if args.rate_limit is not None:
        if args.rate_limit < 1:
            raise CliError("--rate-limit must be at least 1 message per second", 2)
        limits["rate_limit"] = args.rate_limit
    if args.ttl is not None:
        ttl_ms = _duration_ms(args.ttl)
        if ttl_ms < 1:
            raise CliError("--ttl must be at least 1ms", 2)
        limits["ttl_ms"] = ttl_ms
    if args.max_attempts is not None:
        if args.max_attempts < 1:
            raise CliError("--max-attempts must be at least 1", 2)
        limits["max_attempts"] = args.max_attempts
    if args.retention is not None:
        limits["retention_ms"] = _duration_ms(args.retention)
    return limits


def cmd_channel(args: argparse.Namespace) -> None:
    import registry

    if args.action in ("pause", "unpause", "empty"):
        _channel_on_server(args)
        return
    if args.action == "seek":
        _channel_seek(args)
        return
    if args.action == "add" and (args.start_time is not None or args.start_id is not None):
        from dmq_server.admin.channel_start import add_started_channel

        add_started_channel(args)
        return
    with _registry(args) as reg:
        try:
            if args.action == "add":
                reg.add_channel(args.topic, args.name)
                print(f"added channel {args.name} to topic {args.topic}")
            else:
                reg.remove_channel(args.topic, args.name)
                print(f"removed channel {args.name} from topic {args.topic}")
        except registry.RegistryError as exc:
            raise CliError(str(exc)) from exc


def _channel_seek(args: argparse.Namespace) -> None:
    """Seek a channel on every cluster (straight to PostgreSQL, no server needed): one
    transaction each, audited on the main cluster. Running nodes apply it at their next
    channel-state read (--channel-state-interval, 5 s), or at once when they are told of
    it otherwise (an ack of theirs refused, the admin API of one of them)."""
    from dmq_server.admin.cli_operations import _actor
    from dmq_server.admin.cli_support import open_clusters
    from dmq_server.admin.seek_request import describe_seek, parse_seek, report, summary
    from dmq_server.core.errors import Invalid
    from dmq_server.db.admin_steps import log_operation_steps
    from dmq_server.db.seek import NoSuchChannel, SeekRefused, seek_channel_steps
    from dmq_server.db.steps import run_steps

    try:
        target = parse_seek({"to_time": args.to_time, "to_id": args.to_id, "by": args.by,
                             "to_latest": "true" if args.to_latest else None})
    except Invalid as exc:
        raise CliError(exc.description, 2) from exc
    reports = []
    done = []
    count = 0
    strays: list[str] = []
    with open_clusters(args) as conns:
        spec = _seek_spec(args)
        for name, conn in conns.items():
            try:
                with conn.transaction():
                    sought = run_steps(conn, seek_channel_steps(args.topic, args.name, target, args.dry_run,
                                                                from_archive=args.from_archive))
            except NoSuchChannel as exc:
                raise CliError(str(exc), 1) from exc
            except SeekRefused as exc:
                raise CliError(f"{args.topic}/{args.name}: {exc}", 1) from exc
            count += sought.count
            done.append(sought)
            reports.append(report(name, sought, args.dry_run, args.topic, args.name))
            if spec is not None and sought.count and name not in spec.clusters:
                strays.append(name)
                reports[-1]["drains_again"] = True
            if not args.json:
                print(summary(args.topic, args.name, name, sought, args.dry_run))
        if strays and spec is not None:
            _drain_again(args, conns, spec, strays)
        if not args.dry_run and "main" in conns:
            run_steps(conns["main"], log_operation_steps(
                "cli", _actor(), "channel.seek", describe_seek(args.topic, args.name, target, done), count))
    if args.json:
        print(json.dumps(reports, indent=2))


def _seek_spec(args: argparse.Namespace) -> Any:
    """The topic's registered settings, for its placement (None: not registered, which the
    seek itself then refuses with its own message)."""
    import registry

    with _registry(args) as reg:
        try:
            return reg.get_topic(args.topic)
        except registry.RegistryError:
            return None


def _drain_again(args: argparse.Namespace, conns: dict[str, Any], spec: Any, strays: list[str]) -> None:
    """A seek made messages pending on clusters the topic was moved away from (``dmq topic
    move`` finished: nodes deliver its copies only from its cluster and those draining):
    the topic drains them again, as after a move, so a node delivers the replay from there;
    ``dmq topic move T --cluster C`` finishes it (an ordered topic's new messages wait for
    it, to keep each key's order). A dry run only says so."""
    from registry.pg import mirror_topics

    listed = ", ".join(strays)
    how = (f"`dmq topic move {spec.name} --cluster {spec.cluster}` finishes it once they are delivered"
           + ("; until then the topic's new messages wait (it is ordered)" if spec.ordered else ""))
    if args.dry_run:
        print(f"topic {spec.name} would drain {listed} again (it was moved to {spec.cluster}); {how}",
              file=sys.stderr if args.json else sys.stdout)
        return
    import registry

    with _registry(args) as reg:
        try:
            now = reg.get_topic(spec.name)
            reg.place_topic(spec.name, now.cluster, tuple(sorted(set(now.draining) | set(strays))))
            topics = reg.topics()
        except registry.RegistryError as exc:
            raise CliError(f"{spec.name}: sought, but it could not drain {listed} again ({exc}): the messages "
                           "made pending there wait until it does; run the seek again (it is absolute)", 1) from exc
    for conn in conns.values():
        mirror_topics(conn, topics)  # the placement, as every node mirrors it
    print(f"topic {spec.name} drains {listed} again for the replay (it was moved to {spec.cluster}); {how}",
          file=sys.stderr if args.json else sys.stdout)


def _channel_on_server(args: argparse.Namespace) -> None:
    """Pause, unpause or empty a channel through a running server (nsqd's HTTP API on
    --http-address): the server holds the channel's copies in memory, so only it can
    drop them or stop pushing them at once. A pause is stored in PostgreSQL: every node
    of a cluster keeps to it, and a restart does too."""
    query = urllib.parse.urlencode({"topic": args.topic, "channel": args.name})
    url = f"http://{args.http_address}/channel/{args.action}?{query}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30):
            pass
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc).get("message", exc.reason)
        except ValueError:
            message = exc.reason
        raise CliError(f"{args.topic}/{args.name}: {message}", 1 if exc.code == 404 else 3) from exc
    except OSError as exc:
        raise CliError(f"no server reachable at http://{args.http_address}: {exc}", 3) from exc
    done = {"pause": "paused", "unpause": "unpaused", "empty": "emptied"}[args.action]
    print(f"{done} channel {args.name} of topic {args.topic}")


def cmd_stats(args: argparse.Namespace) -> None:
    import registry
    from dmq_server.db.admin_steps import table_counts_steps
    from dmq_server.db.steps import run_steps

    with _database(args) as conn:
        stored = run_steps(conn, table_counts_steps())
        # every registered reliable channel, 0 where nothing waits (the count lists only the others)
        waiting = {(c["topic"], c["channel"]): c["stored_depth"] for c in stored["channels"]}
        named = {(t.name, c) for t in registry.topics(conn) if t.store == "reliable" for c in t.channels}
        stored["channels"] = [{"topic": t, "channel": c, "stored_depth": waiting.get((t, c), 0)}
                              for t, c in sorted(named | set(waiting))]
    live = None
    try:
        with urllib.request.urlopen(f"http://{args.http_address}/stats", timeout=2) as resp:
            live = json.load(resp)
    except (OSError, ValueError):
        live = None
    if args.json:
        print(json.dumps({"stored": stored, "server": live}, indent=2))
        return
    print(
        f"stored: {stored['messages']} messages, {stored['deliveries_pending']} unacknowledged "
        f"deliveries, {stored['delivery_log']} delivery log rows, {stored['dead_letters']} dead letters"
    )
    for ch in stored["channels"]:
        print(f"  {ch['topic']}/{ch['channel']}: {ch['stored_depth']} waiting")
    if live is None:
        print(f"server: not reachable at http://{args.http_address}/stats")
    else:
        print(f"server {live['node_id']}: health {live['health']}, published {live['published']}")
        for topic in live["topics"]:
            for ch in topic["channels"]:
                print(
                    f"  {topic['topic_name']}/{ch['channel_name']}: {ch['clients']} consumers, "
                    f"{ch['in_flight_count']} in flight, {ch['depth']} ready in memory"
                )


def cmd_db(args: argparse.Namespace) -> None:
    from dmq_server.db.schema import schema_version

    from dmq_server.admin.cli_support import cluster_dsns
    from dmq_server.db.storage_errors import StorageError
    from dmq_server.db.schema import migrate

    # _database applies pending migrations before handing out the connection
    with _database(args) as conn:
        version = schema_version(conn)
    print(f"schema is at version {version}" if args.action == "migrate" else version)
    for name, dsn in cluster_dsns(args).items():  # every --pg-cluster as well
        try:
            if args.action == "migrate":
                migrate(dsn)
            with connect_cluster(name, dsn) as conn:
                other = schema_version(conn)
        except StorageError as exc:
            raise CliError(f"cluster {name!r}: {exc}", 3) from exc
        print(f"cluster {name}: schema is at version {other}" if args.action == "migrate" else f"{name} {other}")


def cmd_node(args: argparse.Namespace) -> None:
    """Live nodes of a cluster (ZooKeeper's /dmq/node)."""
    if not args.zk:
        raise CliError("node list needs --zk (a single node registers nowhere)", 2)
    import time

    with _registry(args) as reg:
        nodes = reg.nodes()
    if args.json:
        print(json.dumps([_node_dict(n) for n in nodes], indent=2))
        return
    for node in nodes:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(node.start_time))
        print(f"{node.node_id}\ttcp {node.tcp_address}\thttp {node.http_address}\tstarted {started}")


def _node_dict(node: NodeInfo) -> dict:
    return {
        "node_id": node.node_id,
        "host": node.host,
        "tcp_port": node.tcp_port,
        "http_port": node.http_port,
        "version": node.version,
        "start_time": node.start_time,
        "last_heartbeat": node.last_heartbeat,
        "fast_topics": {k: list(v) for k, v in node.fast_topics.items()},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmq", description="dmq admin command line")
    parser.add_argument("--pg-dsn", default=os.environ.get("DMQ_PG_DSN", ""), help="PostgreSQL DSN (env DMQ_PG_DSN)")
    parser.add_argument(
        "--data-path",
        default=os.environ.get("DMQ_DATA_PATH", "./dmq-data"),
        help="data directory of an embedded-PostgreSQL dmq (env DMQ_DATA_PATH)",
    )
    parser.add_argument(
        "--http-address",
        default=os.environ.get("DMQ_HTTP_ADDRESS", "127.0.0.1:4151"),
        help="a server's HTTP address, for live stats",
    )
    parser.add_argument(
        "--zk",
        default=os.environ.get("DMQ_ZK", ""),
        help="ZooKeeper HOST:PORT[,...][/chroot] of a cluster: topic, channel and node "
        "commands use its registry (env DMQ_ZK)",
    )
    parser.add_argument(
        "--zk-timeout", type=float, default=10.0, help="seconds to wait for ZooKeeper (default 10)"
    )
    parser.add_argument(
        "--pg-cluster", action="append", metavar="NAME=DSN",
        default=[os.environ["DMQ_PG_CLUSTER"]] if os.environ.get("DMQ_PG_CLUSTER") else [],
        help="another PostgreSQL cluster, as the servers' --pg-cluster (repeat; env DMQ_PG_CLUSTER): "
        "topic move and the dead-letter commands use them",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    node = sub.add_parser("node", help="cluster nodes (needs --zk)")
    nsub = node.add_subparsers(dest="action", required=True)
    nodes = nsub.add_parser("list", help="list live nodes")
    nodes.add_argument("--json", action="store_true")
    node.set_defaults(func=cmd_node)

    topic = sub.add_parser("topic", help="manage topics")
    tsub = topic.add_subparsers(dest="action", required=True)
    create = tsub.add_parser("create", help="register a topic")
    create.add_argument("name")
    create.add_argument("--msg-timeout", default="60s", help="redelivery timeout (default 60s)")
    create.add_argument("--store", default="reliable", choices=["reliable", "fast"])
    create.add_argument("--cluster", default="main",
                        help="the PostgreSQL cluster its messages are stored on (default main; see --pg-cluster)")
    create.add_argument("--rate-limit", type=int, default=None, metavar="N",
                        help="most sends per second per node; more are refused and dead-lettered")
    create.add_argument("--ttl", default=None, metavar="DURATION",
                        help="copies not acknowledged within this become dead letters (expired)")
    create.add_argument("--max-attempts", type=int, default=None, metavar="N",
                        help="deliveries per copy before it becomes a dead letter (default unlimited)")
    create.add_argument("--retention", default=None, metavar="DURATION",
                        help="keep a message every channel is done with this long, for `dmq channel seek` "
                        "(at least 1s; default: the server's --message-retention)")
    create.add_argument("--ordered", action="store_true",
                        help="per channel, at most one copy of a message key in flight at a time: the next "
                        "message of a key waits until the one before is acknowledged or dead-lettered "
                        "(a message without a key is its own key; docs/admin.md)")
    update = tsub.add_parser(
        "update",
        help="change a topic's limits or ordering in place (channels and stored messages stay)",
        description="Change a topic's settings without deleting it; give at least one. "
        "'none' removes a limit. Running servers apply the change at their next registry refresh.",
    )
    update.add_argument("name")
    update.add_argument("--msg-timeout", dest="msg_timeout_ms", type=_setting("duration"), default=_UNSET,
                        metavar="DURATION", help="redelivery timeout")
    update.add_argument("--rate-limit", dest="rate_limit", type=_setting("count"), default=_UNSET,
                        metavar="N|none", help="most sends per second per node")
    update.add_argument("--ttl", dest="ttl_ms", type=_setting("duration"), default=_UNSET,
                        metavar="DURATION|none", help="copies not acknowledged within this become dead letters")
    update.add_argument("--max-attempts", dest="max_attempts", type=_setting("count"), default=_UNSET,
                        metavar="N|none", help="deliveries per copy before it becomes a dead letter")
    update.add_argument("--retention", dest="retention_ms", type=_setting("duration"), default=_UNSET,
                        metavar="DURATION|none", help="how long a message every channel is done with is kept")
    update.add_argument("--ordered", action=argparse.BooleanOptionalAction, default=_UNSET,
                        help="--ordered: per channel, at most one copy of a message key in flight at a time; "
                        "--no-ordered: keys no longer wait for each other. Allowed while messages wait: "
                        "the rule applies to deliveries from then on")
    update.set_defaults(func=cmd_topic_update)
    for action in ("delete", "show"):
        p = tsub.add_parser(action, help=f"{action} a topic")
        p.add_argument("name")
    lst = tsub.add_parser("list", help="list topics")
    lst.add_argument("--json", action="store_true")
    topic.set_defaults(func=cmd_topic)
    from dmq_server.admin.cli_clusters import add_cluster_commands

    add_cluster_commands(tsub)

    channel = sub.add_parser("channel", help="manage a topic's channels (consumer groups)")
    csub = channel.add_subparsers(dest="action", required=True)
    for action, what in (
        ("add", "register a channel"),
        ("remove", "unregister a channel (its waiting copies go)"),
        ("pause", "stop pushing a channel's copies (through the server at --http-address)"),
        ("unpause", "push a paused channel's copies again (through the server)"),
        ("empty", "drop every waiting and in-flight copy of a channel (through the server)"),
    ):
        p = csub.add_parser(action, help=what)
        p.add_argument("topic")
        p.add_argument("name")
        if action == "add":
            start = p.add_mutually_exclusive_group()
            start.add_argument("--start-time", metavar="TIME",
                               help="first deliver the retained messages published at or after TIME (Unix ms, "
                                    "ISO 8601 or a duration ago: 1h), on every cluster; default: from now on")
            start.add_argument("--start-id", metavar="ID", help="first deliver the retained messages from this id on")
            p.add_argument("--json", action="store_true", help="with a start: the seek's answer per cluster as JSON")
    seek = csub.add_parser("seek", help="deliver a channel's stored messages again from a time or an id "
                                        "(or skip what waits: --to-latest), on every cluster")
    seek.add_argument("topic")
    seek.add_argument("name")
    to = seek.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-time", metavar="TIME",
                    help="the messages published at or after TIME: Unix ms, ISO 8601 or a duration ago (1h)")
    to.add_argument("--to-id", metavar="ID", help="the messages with this id or a higher one")
    to.add_argument("--by", metavar="-DURATION", help="back from now: --by -1h is --to-time 1h")
    to.add_argument("--to-latest", action="store_true", help="none of those stored now (skip what waits)")
    seek.add_argument("--from-archive", action="store_true",
                      help="a time before the topic's retained start: seek to that start instead of refusing, and "
                           "print the `dmq-pipeline reinject` command that queues the gap from the archive")
    seek.add_argument("--dry-run", action="store_true", help="say how many would be delivered again; change nothing")
    seek.add_argument("--json", action="store_true")
    channel.set_defaults(func=cmd_channel)

    stats = sub.add_parser("stats", help="stored and live statistics")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=cmd_stats)

    from dmq_server.admin.cli_operations import add_admin_commands

    add_admin_commands(sub)
    from dmq_server.admin.cli_outbox import add_outbox_commands

    add_outbox_commands(sub)

    db = sub.add_parser("db", help="schema management")
    dsub = db.add_subparsers(dest="action", required=True)
    dsub.add_parser("migrate", help="apply pending migrations")
    dsub.add_parser("version", help="print the schema version")
    db.set_defaults(func=cmd_db)
    return parser


def _signed_values(argv: list[str]) -> list[str]:
    """``--by -1h`` as ``--by=-1h``: argparse takes a value starting with '-' (not a plain
    negative number) for an option of its own."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--by" and arg.startswith("-"):
            out[-1] = f"--by={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from dmq_client.pipes import quiet_broken_pipe

    with quiet_broken_pipe() as closed:
        args = build_parser().parse_args(_signed_values(sys.argv[1:] if argv is None else list(argv)))
        try:
            args.func(args)
        except CliError as exc:
            print(f"dmq: {exc}", file=sys.stderr)
            return exc.code
        return 0
    return closed.code


if __name__ == "__main__":
    # run the imported module's main, so `python -m dmq_server.admin.cli` and the `dmq` script
    # share one CliError class with the command modules (``cli_operations``)
    from dmq_server.admin.cli import main as _main

    sys.exit(_main())
