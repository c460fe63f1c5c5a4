"""``dmq channel add TOPIC CHANNEL --start-time TIME | --start-id N``: a channel (consumer
group) that first receives the retained messages from a time or an id, not only those
stored from now on (issue 46).

On every cluster, in one transaction each (``db.seek.start_channel_steps``): the
registry's rows of the topic and the channel are written into that cluster's database as a
node's mirror would, then the channel is sought to its start. Without ZooKeeper the main
cluster's transaction is the registration itself (the registry is its ``dmq_channel``), so
a refused start there registers nothing; with --zk the channel's znode is created first.
A channel whose row the transaction inserts keeps epoch 0: no node can have read it, and
one that opens it reads the sought cursors at once. No server is needed.

Before registering, the same transaction runs on every cluster as a dry run and is rolled
back, so a start that would be refused (a time in the future, before the topic's retained
start, older than its time to live) registers nothing. The seek checks again under the
topic's lock; a refusal then can only come from a race (the retention sweep removed the
start meanwhile). Where the registration is already done (ZooKeeper, or a second
cluster), the channel stays registered, starting at the latest message where it was not
sought, and the error says so and names ``dmq channel seek``: removing it again would drop
the copies of messages stored since, which consumers that subscribed meanwhile may already
be receiving, and with ZooKeeper a removal races every node's mirror.
"""

from __future__ import annotations

import argparse
import json

from dmq_server.admin.cli_support import CliError, open_clusters, open_registry
from dmq_server.admin.seek_request import describe_target, parse_seek, report, summary
from dmq_server.core.errors import Invalid
from dmq_server.db.admin_steps import log_operation_steps
from dmq_server.db.seek import SeekRefused, SeekTarget, start_channel_steps
from dmq_server.db.steps import run_steps

__all__ = ["add_started_channel", "parse_start"]


def parse_start(start_time: str | None, start_id: str | None) -> SeekTarget:
    """The start --start-time or --start-id names (one of them), as a seek's target;
    CliError 2 for one that does not parse."""
    try:
        return parse_seek({"to_time": start_time, "to_id": start_id})
    except Invalid as exc:
        message = exc.description.replace("to_time:", "--start-time:").replace("to_id:", "--start-id:")
        raise CliError(message, 2) from exc


def add_started_channel(args: argparse.Namespace) -> None:
    """Check the start on every cluster, register the channel, seek it everywhere; print
    what ``dmq channel seek`` prints, and audit it as ``channel.add`` with its start."""
    from registry.interface import check_name

    from dmq_server.admin.cli_operations import _actor
    from registry.model import RegistryError

    topic, channel = args.topic, args.name
    target = parse_start(args.start_time, args.start_id)
    where = f"{topic}/{channel}"

    def unregistered(cluster: str, refused: SeekRefused) -> str:
        return f"cannot start {where} from {describe_target(target)} on cluster {cluster}: {refused}; nothing was registered"
    with open_registry(args) as reg, open_clusters(args) as conns:
        try:
            check_name("channel", channel)
            spec = reg.get_topic(topic)
        except RegistryError as exc:
            raise CliError(str(exc)) from exc
        if channel in spec.channels:
            raise CliError(f"channel {channel!r} already exists on topic {topic!r}")
        for name, conn in conns.items():
            try:
                with conn.transaction(force_rollback=True):
                    run_steps(conn, start_channel_steps(spec, channel, target, dry_run=True))
            except SeekRefused as exc:
                raise CliError(unregistered(name, exc)) from exc
        if args.zk:  # else the main cluster's transaction below registers it (PgRegistry's row)
            try:
                reg.add_channel(topic, channel)
                spec = reg.get_topic(topic)
            except RegistryError as exc:
                raise CliError(str(exc)) from exc

        def audit(refused: bool) -> None:
            if "main" in conns:
                what = f"{where} from {describe_target(target)}" + (
                    " (start refused: from the latest message)" if refused else "")
                run_steps(conns["main"], log_operation_steps("cli", _actor(), "channel.add", what, count))

        reports: list[dict[str, object]] = []
        lines = [f"added channel {channel} to topic {topic}"]
        count = 0
        for name, conn in conns.items():
            try:
                with conn.transaction():
                    sought = run_steps(conn, start_channel_steps(spec, channel, target))
            except SeekRefused as exc:
                if not reports and not args.zk:  # the registration itself was rolled back
                    raise CliError(unregistered(name, exc)) from exc
                audit(refused=True)
                late = [n for n in conns if n not in {r["cluster"] for r in reports}]
                raise CliError(
                    f"{where}: the channel is registered, but its start was refused on cluster {name}: {exc}. "
                    f"It starts at the latest message on cluster{'s' if len(late) > 1 else ''} {', '.join(late)}"
                    + (f" (sought on {', '.join(str(r['cluster']) for r in reports)})" if reports else "")
                    + f"; move it with: dmq channel seek {topic} {channel} --to-time TIME") from exc
            count += sought.count
            reports.append(report(name, sought, False))
            lines.append(summary(topic, channel, name, sought, False))
        audit(refused=False)
    print(json.dumps(reports, indent=2) if args.json else "\n".join(lines))
